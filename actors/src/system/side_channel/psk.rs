//! [`Psk`]: the side channel's pre-shared key, and how it is read from a file.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The shortest key taken, in bytes: 128 bits, so that guessing it is out of reach even for a
/// key of random bytes, and a hex or base64 key of 16 characters at least is still refused
/// below 16 bytes.
pub const PSK_MIN_LEN: usize = 16;

/// The longest key taken, in bytes (HMAC hashes a longer key down to 32 bytes anyway; the bound
/// keeps a wrong path, such as a log or a device, from being read whole).
pub const PSK_MAX_LEN: usize = 1024;

/// Why a pre-shared key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PskError {
    /// The file could not be opened or read.
    #[error("cannot read the key file {path}: {detail}")]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        detail: String,
    },
    /// The key is empty (after the trailing newline is trimmed).
    #[error("the pre-shared key is empty")]
    Empty,
    /// The key is shorter than [`PSK_MIN_LEN`].
    #[error("the pre-shared key has {len} bytes; at least {min} are needed")]
    TooShort {
        /// Its length.
        len: usize,
        /// [`PSK_MIN_LEN`].
        min: usize,
    },
    /// The key is longer than [`PSK_MAX_LEN`].
    #[error("the pre-shared key is longer than {max} bytes")]
    TooLong {
        /// [`PSK_MAX_LEN`].
        max: usize,
    },
}

/// A pre-shared key for the side channel's handshake authentication
/// ([`SideChannelConfig::psk`](super::SideChannelConfig::psk)): between [`PSK_MIN_LEN`] and
/// [`PSK_MAX_LEN`] bytes. Cheap to clone (shared); its bytes are overwritten when the last
/// clone is dropped, and never printed (`Debug` shows the length only).
///
/// ```
/// use kvhandoff_actors::system::{Psk, PskError};
/// let key = Psk::new(*b"0123456789abcdef").unwrap();
/// assert_eq!(key.len(), 16);
/// assert_eq!(format!("{key:?}"), "Psk(16 bytes)");
/// assert_eq!(Psk::new(*b"short"), Err(PskError::TooShort { len: 5, min: 16 }));
/// ```
#[derive(Clone)]
pub struct Psk(Arc<Secret>);

struct Secret(Vec<u8>);

impl Drop for Secret {
    fn drop(&mut self) {
        for byte in self.0.iter_mut() {
            // Volatile, so that the compiler cannot drop the store as dead.
            // SAFETY: `byte` is a valid, aligned, exclusive reference.
            unsafe { std::ptr::write_volatile(byte, 0) };
        }
    }
}

impl Psk {
    /// The key of these bytes, taken as they are.
    ///
    /// # Errors
    /// [`PskError::Empty`], [`PskError::TooShort`] or [`PskError::TooLong`].
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Psk, PskError> {
        let bytes = bytes.into();
        let key = Psk(Arc::new(Secret(bytes)));
        match key.len() {
            0 => Err(PskError::Empty),
            len if len < PSK_MIN_LEN => Err(PskError::TooShort {
                len,
                min: PSK_MIN_LEN,
            }),
            len if len > PSK_MAX_LEN => Err(PskError::TooLong { max: PSK_MAX_LEN }),
            _ => Ok(key),
        }
    }

    /// The key in the file at `path`: its bytes, less one trailing newline (`\n` or `\r\n`,
    /// as `echo` or an editor leaves). At most [`PSK_MAX_LEN`] + 2 bytes are read.
    ///
    /// # Errors
    /// [`PskError::Unreadable`] for a missing or unreadable file, otherwise as [`Psk::new`].
    pub fn from_file(path: &Path) -> Result<Psk, PskError> {
        let unreadable = |e: std::io::Error| PskError::Unreadable {
            path: path.to_path_buf(),
            detail: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        let mut bytes = Vec::new();
        // One byte past the longest key with its newline: enough to tell "too long".
        let cap = u64::try_from(PSK_MAX_LEN + 3).unwrap_or(u64::MAX);
        file.take(cap).read_to_end(&mut bytes).map_err(unreadable)?;
        if bytes.ends_with(b"\r\n") {
            bytes.truncate(bytes.len() - 2);
        } else if bytes.ends_with(b"\n") {
            bytes.truncate(bytes.len() - 1);
        }
        Psk::new(bytes)
    }

    /// The key's length in bytes (never 0).
    pub fn len(&self) -> usize {
        self.0 .0.len()
    }

    /// Always false: a key has at least [`PSK_MIN_LEN`] bytes.
    pub fn is_empty(&self) -> bool {
        self.0 .0.is_empty()
    }

    pub(super) fn bytes(&self) -> &[u8] {
        &self.0 .0
    }
}

impl PartialEq for Psk {
    /// Whether both keys have the same bytes (compared in full, whatever differs first).
    fn eq(&self, other: &Psk) -> bool {
        let (a, b) = (self.bytes(), other.bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl Eq for Psk {}

impl fmt::Debug for Psk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Psk({} bytes)", self.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(bytes: &[u8]) -> (std::path::PathBuf, impl Drop) {
        struct Remove(std::path::PathBuf);
        impl Drop for Remove {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("kvhandoff-psk-{}-{n}", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        (path.clone(), Remove(path))
    }

    #[test]
    fn files_are_validated_and_one_newline_trimmed() {
        let key = |bytes: &[u8]| {
            let (path, _guard) = file_with(bytes);
            Psk::from_file(&path)
        };
        let sixteen = b"0123456789abcdef";
        assert_eq!(key(sixteen).unwrap().len(), 16);
        assert_eq!(key(b"0123456789abcdef\n").unwrap(), key(sixteen).unwrap());
        assert_eq!(key(b"0123456789abcdef\r\n").unwrap(), key(sixteen).unwrap());
        // Only one newline goes: a second is the key's.
        assert_eq!(key(b"0123456789abcdef\n\n").unwrap().len(), 17);
        assert_eq!(key(b""), Err(PskError::Empty));
        assert_eq!(key(b"\n"), Err(PskError::Empty));
        assert_eq!(
            key(b"0123456789abcde\n"),
            Err(PskError::TooShort { len: 15, min: 16 })
        );
        assert_eq!(key(&[b'k'; PSK_MAX_LEN]).unwrap().len(), PSK_MAX_LEN);
        assert_eq!(
            key(&[b'k'; PSK_MAX_LEN + 1]),
            Err(PskError::TooLong { max: PSK_MAX_LEN })
        );
        assert_eq!(
            key(&[b'k'; 1 << 20]),
            Err(PskError::TooLong { max: PSK_MAX_LEN })
        );
        let missing = std::env::temp_dir().join("kvhandoff-psk-no-such-file");
        assert!(matches!(
            Psk::from_file(&missing),
            Err(PskError::Unreadable { .. })
        ));
    }

    #[test]
    fn keys_compare_by_bytes_and_never_print() {
        let a = Psk::new(*b"0123456789abcdef").unwrap();
        let b = Psk::new(*b"0123456789abcdeX").unwrap();
        assert_ne!(a, b);
        assert_eq!(a, a.clone());
        assert!(!format!("{a:?}").contains("0123"));
    }
}
