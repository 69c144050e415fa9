//! The pre-shared-key authentication of one exchange: fixed-size auth frames around the
//! unchanged handshake frames, HMAC-SHA256 over both sides' fresh nonces and the handshake
//! bytes (see the parent module's "Authentication").

use actix::clock::Instant;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::psk::Psk;
use super::{HandshakeError, MAGIC};

/// The first bytes of every auth frame ("KVHO" starts a protocol frame).
pub(crate) const AUTH_MAGIC: [u8; 4] = *b"KVHA";
/// The auth frames' own version: the exchange can change without the protocol's version.
const AUTH_VERSION: u8 = 1;
/// Magic, version, step, two reserved zero bytes.
const AUTH_HEADER_LEN: usize = 8;
/// Bytes of each side's nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 tag.
pub const MAC_LEN: usize = 32;

/// What each MAC says it is, so that no MAC of one step passes for another (a listener's proof
/// is not an initiator's tag, a tag over one handshake is not one over the pair).
const LABEL_PROOF: &[u8] = b"kvhandoff side channel psk v1: listener proof";
const LABEL_INITIATOR: &[u8] = b"kvhandoff side channel psk v1: initiator handshake";
const LABEL_LISTENER: &[u8] = b"kvhandoff side channel psk v1: listener handshake";

type HmacSha256 = Hmac<Sha256>;

/// The auth frames, each of a fixed size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Step {
    /// Initiator → listener: the initiator's nonce.
    Hello = 1,
    /// Listener → initiator: the listener's nonce and its proof of the key.
    Challenge = 2,
    /// After a handshake frame: the MAC binding it to both nonces.
    Tag = 3,
}

impl Step {
    const fn body_len(self) -> usize {
        match self {
            Step::Hello => NONCE_LEN,
            Step::Challenge => NONCE_LEN + MAC_LEN,
            Step::Tag => MAC_LEN,
        }
    }
}

/// Why the authentication of an exchange failed. Each is counted as
/// [`RejectReason::AuthenticationFailed`](super::RejectReason::AuthenticationFailed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    /// (A rank with a key.) The peer sent a plain handshake: it has no key.
    #[error("the peer sent an unauthenticated handshake (it has no pre-shared key)")]
    PeerHasNoKey,
    /// (A rank without a key.) The peer opened with an auth frame: it has a key, we have none.
    #[error("the peer authenticates with a pre-shared key and this rank has none")]
    NoKeyHere,
    /// (Initiator.) The listener's proof does not verify: the keys differ.
    #[error("the listener's proof of the pre-shared key does not verify (the keys differ)")]
    BadProof,
    /// The MAC of the peer's handshake does not verify: another key, or altered or replayed
    /// bytes.
    #[error("the handshake's MAC does not verify (another key, or altered or replayed bytes)")]
    BadMac,
    /// (Initiator.) The listener closed without a challenge: it has no key, or refused the
    /// connection before reading it (a busy listener does that too).
    #[error("the listener closed without a challenge (it has no pre-shared key, or refused us)")]
    NoChallenge,
    /// (Listener.) The initiator closed after our challenge: it refused our proof (the keys
    /// differ) or gave up.
    #[error("the initiator closed after the challenge (it refused our proof: the keys differ)")]
    Abandoned,
    /// An auth frame with another version or step, or reserved bits set.
    #[error("a malformed auth frame")]
    BadFrame,
}

impl From<AuthFailure> for HandshakeError {
    fn from(failure: AuthFailure) -> Self {
        HandshakeError::Authentication(failure)
    }
}

/// One exchange's nonces: the initiator's, then the listener's.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Nonces {
    pub(crate) initiator: [u8; NONCE_LEN],
    pub(crate) listener: [u8; NONCE_LEN],
}

/// A fresh nonce from the operating system's generator.
pub(crate) fn nonce() -> Result<[u8; NONCE_LEN], HandshakeError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut nonce).map_err(|e| HandshakeError::Io {
        kind: std::io::ErrorKind::Other,
        detail: format!("no random nonce: {e}"),
    })?;
    Ok(nonce)
}

/// The HMAC of `label`, both nonces and each of `frames` (length-prefixed, so that no two
/// splits of the same bytes give the same input).
fn mac(key: &Psk, label: &[u8], nonces: &Nonces, frames: &[&[u8]]) -> HmacSha256 {
    // HMAC takes a key of any length: `new_from_slice` cannot fail for it.
    let mut mac = match HmacSha256::new_from_slice(key.bytes()) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC accepts keys of every length"),
    };
    mac.update(label);
    mac.update(&nonces.initiator);
    mac.update(&nonces.listener);
    for frame in frames {
        let len = u64::try_from(frame.len()).unwrap_or(u64::MAX);
        mac.update(&len.to_le_bytes());
        mac.update(frame);
    }
    mac
}

fn tag_bytes(mac: HmacSha256) -> [u8; MAC_LEN] {
    mac.finalize().into_bytes().into()
}

/// The listener's proof of the key, over both nonces.
pub(crate) fn proof(key: &Psk, nonces: &Nonces) -> [u8; MAC_LEN] {
    tag_bytes(mac(key, LABEL_PROOF, nonces, &[]))
}

/// Checks the listener's proof (in constant time).
pub(crate) fn verify_proof(key: &Psk, nonces: &Nonces, proof: &[u8]) -> Result<(), HandshakeError> {
    mac(key, LABEL_PROOF, nonces, &[])
        .verify_slice(proof)
        .map_err(|_| AuthFailure::BadProof.into())
}

/// The initiator's tag over its handshake frame.
pub(crate) fn initiator_tag(key: &Psk, nonces: &Nonces, ours: &[u8]) -> [u8; MAC_LEN] {
    tag_bytes(mac(key, LABEL_INITIATOR, nonces, &[ours]))
}

/// Checks the initiator's tag (in constant time).
pub(crate) fn verify_initiator(
    key: &Psk,
    nonces: &Nonces,
    theirs: &[u8],
    tag: &[u8],
) -> Result<(), HandshakeError> {
    mac(key, LABEL_INITIATOR, nonces, &[theirs])
        .verify_slice(tag)
        .map_err(|_| AuthFailure::BadMac.into())
}

/// The listener's tag over both handshake frames (the initiator's it answers, then its own).
pub(crate) fn listener_tag(
    key: &Psk,
    nonces: &Nonces,
    initiator: &[u8],
    ours: &[u8],
) -> [u8; MAC_LEN] {
    tag_bytes(mac(key, LABEL_LISTENER, nonces, &[initiator, ours]))
}

/// Checks the listener's tag (in constant time).
pub(crate) fn verify_listener(
    key: &Psk,
    nonces: &Nonces,
    initiator: &[u8],
    theirs: &[u8],
    tag: &[u8],
) -> Result<(), HandshakeError> {
    mac(key, LABEL_LISTENER, nonces, &[initiator, theirs])
        .verify_slice(tag)
        .map_err(|_| AuthFailure::BadMac.into())
}

/// One auth frame of `step` with `body` (of the step's length).
pub(crate) fn frame(step: Step, body: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(AUTH_HEADER_LEN + step.body_len());
    out.extend_from_slice(&AUTH_MAGIC);
    out.extend_from_slice(&[AUTH_VERSION, step as u8, 0, 0]);
    for part in body {
        out.extend_from_slice(part);
    }
    debug_assert_eq!(out.len(), AUTH_HEADER_LEN + step.body_len());
    out
}

/// Reads one auth frame of `step` under `deadline` and returns its body. Its size is fixed by
/// the step: nothing the peer announces is trusted. A plain protocol frame in its place is
/// [`AuthFailure::PeerHasNoKey`].
pub(crate) async fn read_auth<S>(
    stream: &mut S,
    step: Step,
    deadline: Instant,
) -> Result<Vec<u8>, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    let mut header = [0u8; AUTH_HEADER_LEN];
    read_header(
        stream,
        &mut header,
        (&AUTH_MAGIC, &MAGIC, AuthFailure::PeerHasNoKey),
        deadline,
    )
    .await?;
    if header[4..] != [AUTH_VERSION, step as u8, 0, 0] {
        return Err(AuthFailure::BadFrame.into());
    }
    let mut body = vec![0u8; step.body_len()];
    let mut got = 0;
    while got < body.len() {
        let n = read_some(stream, &mut body[got..], deadline).await?;
        if n == 0 {
            return Err(HandshakeError::Truncated {
                got: AUTH_HEADER_LEN + got,
                wanted: AUTH_HEADER_LEN + body.len(),
            });
        }
        got += n;
    }
    Ok(body)
}

/// Fills `header` (a frame's fixed header) under `deadline`, checking its magic as it arrives:
/// `ours` is the frame expected; the other frame family's magic (`theirs`: a plain handshake
/// where an auth frame belongs, or the reverse) is `mismatch` once all of it came, since it
/// says which side lacks a key; anything else is `BadMagic`.
pub(crate) async fn read_header<S>(
    stream: &mut S,
    header: &mut [u8],
    (ours, theirs, mismatch): (&[u8; 4], &[u8; 4], AuthFailure),
    deadline: Instant,
) -> Result<(), HandshakeError>
where
    S: AsyncRead + Unpin,
{
    let mut filled = 0;
    while filled < header.len() {
        let n = read_some(stream, &mut header[filled..], deadline).await?;
        if n == 0 {
            return Err(if filled == 0 {
                HandshakeError::Closed
            } else {
                HandshakeError::Truncated {
                    got: filled,
                    wanted: header.len(),
                }
            });
        }
        filled += n;
        let seen = filled.min(ours.len());
        if header[..seen] != ours[..seen] {
            if header[..seen] == theirs[..seen] {
                // Wait for the whole magic before naming the other frame family.
                if seen == theirs.len() {
                    return Err(mismatch.into());
                }
                continue;
            }
            let mut found = [0u8; 4];
            found[..seen].copy_from_slice(&header[..seen]);
            return Err(kvhandoff_protocol::WireError::BadMagic { found }.into());
        }
    }
    Ok(())
}

async fn read_some<S>(
    stream: &mut S,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<usize, HandshakeError>
where
    S: AsyncRead + Unpin,
{
    tokio::time::timeout_at(deadline, stream.read(buf))
        .await
        .map_err(|_| HandshakeError::TimedOut)?
        .map_err(HandshakeError::io)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(byte: u8) -> Psk {
        Psk::new(vec![byte; 32]).unwrap()
    }

    const NONCES: Nonces = Nonces {
        initiator: [1; NONCE_LEN],
        listener: [2; NONCE_LEN],
    };

    #[test]
    fn macs_bind_key_nonces_step_and_bytes() {
        let (k, other) = (key(7), key(8));
        let hs = b"handshake".as_slice();
        let tag = initiator_tag(&k, &NONCES, hs);
        assert!(verify_initiator(&k, &NONCES, hs, &tag).is_ok());
        let fails = |r: Result<(), HandshakeError>| {
            assert_eq!(r, Err(HandshakeError::Authentication(AuthFailure::BadMac)));
        };
        fails(verify_initiator(&other, &NONCES, hs, &tag));
        fails(verify_initiator(&k, &NONCES, b"handshakE", &tag));
        let fresh = Nonces {
            listener: [3; NONCE_LEN],
            ..NONCES
        };
        fails(verify_initiator(&k, &fresh, hs, &tag));
        // A tag of one step never passes for another.
        fails(verify_listener(&k, &NONCES, b"", hs, &tag));
        let p = proof(&k, &NONCES);
        assert!(verify_proof(&k, &NONCES, &p).is_ok());
        assert_eq!(
            verify_proof(&other, &NONCES, &p),
            Err(AuthFailure::BadProof.into())
        );
        fails(verify_initiator(&k, &NONCES, b"", &p));
        // The split between the two frames is bound too.
        let lt = listener_tag(&k, &NONCES, b"ab", b"c");
        assert!(verify_listener(&k, &NONCES, b"ab", b"c", &lt).is_ok());
        fails(verify_listener(&k, &NONCES, b"a", b"bc", &lt));
        // A short tag is refused, not compared on its prefix.
        fails(verify_initiator(&k, &NONCES, hs, &tag[..16]));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[tokio::test]
    async fn auth_frames_are_fixed_and_checked() {
        let far = Instant::now() + Duration::from_secs(5);
        let hello = frame(Step::Hello, &[&[9; NONCE_LEN]]);
        assert_eq!(hello.len(), 40);
        assert_eq!(
            read_auth(&mut hello.as_slice(), Step::Hello, far).await,
            Ok(vec![9; NONCE_LEN])
        );
        let wrong_step = read_auth(&mut hello.as_slice(), Step::Challenge, far).await;
        assert_eq!(wrong_step, Err(AuthFailure::BadFrame.into()));
        let mut plain: &[u8] = b"KVHO\x01\x00\x01\x00\x10\x00\x00\x00";
        assert_eq!(
            read_auth(&mut plain, Step::Hello, far).await,
            Err(AuthFailure::PeerHasNoKey.into())
        );
        let mut empty: &[u8] = &[];
        assert_eq!(
            read_auth(&mut empty, Step::Hello, far).await,
            Err(HandshakeError::Closed)
        );
        let mut short = &hello[..20];
        assert_eq!(
            read_auth(&mut short, Step::Hello, far).await,
            Err(HandshakeError::Truncated {
                got: 20,
                wanted: 40
            })
        );
        let mut garbage: &[u8] = b"GET / HTTP/1.1\r\n";
        assert!(matches!(
            read_auth(&mut garbage, Step::Hello, far).await,
            Err(HandshakeError::Wire(_))
        ));
    }
}
