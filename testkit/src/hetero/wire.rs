//! How the heterogeneous executor moves bytes from one rank's memory to another's: the
//! in-process copy ([`MemoryWire`]) or real NIXL WRITEs between agents (`NixlWire`, feature
//! `nixl`). The executor hands every transfer of a request to one [`Wire`] call, so a wire can
//! post them all before it waits.

/// One contiguous byte arena owned by one rank: its registered KV memory, or a staging buffer.
///
/// Arenas are allocated once, before the first [`Wire::write_all`], and never resized: a wire
/// may register them with a transport on its first call and keep the registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arena {
    /// Who owns it and what it is, e.g. `"P tp1 pp0 kv"` or `"D tp0 pp0 staging"`.
    pub name: String,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// One piece of a transfer: `len` bytes from `src_offset` of the source arena to `dst_offset`
/// of the destination arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the source arena.
    pub src_offset: u64,
    /// Offset in the destination arena.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Every piece one source arena writes into one destination arena (one NIXL transfer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transfer {
    /// Index of the source arena in the executor's arena list.
    pub src: usize,
    /// Index of the destination arena.
    pub dst: usize,
    /// The pieces, in any order; destination ranges never overlap.
    pub pieces: Vec<Piece>,
}

/// Why a wire could not move a request's bytes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A transfer names an arena that does not exist, or a piece is out of its arena's bounds.
    #[error("transfer {transfer}: {why}")]
    OutOfBounds {
        /// Index of the transfer.
        transfer: usize,
        /// What is out of bounds.
        why: String,
    },
    /// The transport refused or failed (its message).
    #[error("{0}")]
    Transport(String),
}

/// Moves bytes between arenas.
pub trait Wire {
    /// A short name for reports (`"memory"`, `"nixl"`).
    fn name(&self) -> &'static str;

    /// Performs every transfer and returns once all of them landed.
    ///
    /// # Errors
    /// [`WireError`]; on an error the destination arenas may hold any mix of old and new bytes.
    fn write_all(&mut self, arenas: &mut [Arena], transfers: &[Transfer]) -> Result<(), WireError>;
}

/// Checks every transfer against the arenas' bounds before anything moves.
///
/// # Errors
/// [`WireError::OutOfBounds`] for the first transfer that does not fit.
pub fn check_bounds(arenas: &[Arena], transfers: &[Transfer]) -> Result<(), WireError> {
    for (index, t) in transfers.iter().enumerate() {
        let bad = |why: String| {
            Err(WireError::OutOfBounds {
                transfer: index,
                why,
            })
        };
        if t.src == t.dst {
            return bad(format!("source and destination are both arena {}", t.src));
        }
        let (Some(src), Some(dst)) = (arenas.get(t.src), arenas.get(t.dst)) else {
            return bad(format!("arena {} or {} does not exist", t.src, t.dst));
        };
        for p in &t.pieces {
            let fits = |start: u64, arena: &Arena| {
                start
                    .checked_add(p.len)
                    .is_some_and(|end| end <= arena.bytes.len() as u64)
            };
            if !fits(p.src_offset, src) || !fits(p.dst_offset, dst) {
                return bad(format!(
                    "piece {p:?} out of bounds ({} bytes -> {} bytes)",
                    src.bytes.len(),
                    dst.bytes.len()
                ));
            }
        }
    }
    Ok(())
}

/// The in-process wire: a `copy_from_slice` per piece.
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryWire;

impl Wire for MemoryWire {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn write_all(&mut self, arenas: &mut [Arena], transfers: &[Transfer]) -> Result<(), WireError> {
        check_bounds(arenas, transfers)?;
        for t in transfers {
            // Two distinct arenas, borrowed apart (checked above).
            let (src, dst) = if t.src < t.dst {
                let (low, high) = arenas.split_at_mut(t.dst);
                (&low[t.src], &mut high[0])
            } else {
                let (low, high) = arenas.split_at_mut(t.src);
                (&high[0], &mut low[t.dst])
            };
            for p in &t.pieces {
                // In bounds and in usize: both arenas hold these bytes (checked above).
                let (s, d, n) = (p.src_offset as usize, p.dst_offset as usize, p.len as usize);
                dst.bytes[d..d + n].copy_from_slice(&src.bytes[s..s + n]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arenas() -> Vec<Arena> {
        vec![
            Arena {
                name: "a".into(),
                bytes: (0..16).collect(),
            },
            Arena {
                name: "b".into(),
                bytes: vec![0; 8],
            },
        ]
    }

    #[test]
    fn memory_wire_copies_pieces_both_ways_and_refuses_out_of_bounds() {
        let mut a = arenas();
        let piece = |src_offset, dst_offset, len| Piece {
            src_offset,
            dst_offset,
            len,
        };
        let forward = Transfer {
            src: 0,
            dst: 1,
            pieces: vec![piece(4, 0, 2), piece(10, 6, 2)],
        };
        MemoryWire.write_all(&mut a, &[forward]).unwrap();
        assert_eq!(a[1].bytes, [4, 5, 0, 0, 0, 0, 10, 11]);
        let back = Transfer {
            src: 1,
            dst: 0,
            pieces: vec![piece(6, 0, 2)],
        };
        MemoryWire.write_all(&mut a, &[back]).unwrap();
        assert_eq!(&a[0].bytes[..3], [10, 11, 2]);
        let too_far = Transfer {
            src: 0,
            dst: 1,
            pieces: vec![piece(0, 7, 2)],
        };
        let before = a.clone();
        assert!(matches!(
            MemoryWire.write_all(&mut a, &[too_far]),
            Err(WireError::OutOfBounds { transfer: 0, .. })
        ));
        assert_eq!(a, before, "a refused call moved nothing");
    }
}
