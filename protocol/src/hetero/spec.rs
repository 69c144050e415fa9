//! A side's geometry on the command line: `tp=N,block=N,layout=NHD|HND[,pp=N][,kbpl=N]`.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use super::{SpecError, MAX_BLOCK_TOKENS, MAX_KBPL};
use crate::geometry::{KvLayout, MAX_PARALLEL};

/// What one engine (every rank of it) is: TP and PP sizes, kernel block size, kernel blocks
/// per logical block and layout. Rank count, dtype and layers come from the model.
///
/// ```
/// use kvhandoff_protocol::hetero::SideSpec;
/// use kvhandoff_protocol::KvLayout;
/// let s: SideSpec = "tp=4,block=16,layout=HND".parse().unwrap();
/// assert_eq!((s.tp, s.pp, s.block, s.kbpl, s.layout), (4, 1, 16, 1, KvLayout::Hnd));
/// assert_eq!(s.to_string(), "tp=4,block=16,layout=HND");
/// let err = "tp=4,block=16,layout=XYZ".parse::<SideSpec>().unwrap_err();
/// assert_eq!(err.to_string(), "layout=\"XYZ\" is neither NHD nor HND");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct SideSpec {
    /// Tensor-parallel size.
    pub tp: u32,
    /// Pipeline-parallel size (default 1).
    pub pp: u32,
    /// Tokens per kernel block.
    pub block: u32,
    /// Kernel blocks per logical block (default 1): a logical block holds `block × kbpl` tokens.
    pub kbpl: u32,
    /// Layout of an attention kernel block.
    pub layout: KvLayout,
}

impl SideSpec {
    /// A spec with PP 1 and one kernel block per logical block.
    pub fn new(tp: u32, block: u32, layout: KvLayout) -> SideSpec {
        SideSpec {
            tp,
            pp: 1,
            block,
            kbpl: 1,
            layout,
        }
    }

    /// Tokens per logical block.
    pub fn logical_block(&self) -> u64 {
        u64::from(self.block) * u64::from(self.kbpl)
    }

    /// Ranks of the engine (TP × PP).
    pub fn ranks(&self) -> u64 {
        u64::from(self.tp) * u64::from(self.pp)
    }
}

/// `"NHD"` or `"HND"`.
pub fn layout_name(layout: KvLayout) -> &'static str {
    match layout {
        KvLayout::Nhd => "NHD",
        KvLayout::Hnd => "HND",
    }
}

impl fmt::Display for SideSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp={}", self.tp)?;
        if self.pp != 1 {
            write!(f, ",pp={}", self.pp)?;
        }
        write!(f, ",block={}", self.block)?;
        if self.kbpl != 1 {
            write!(f, ",kbpl={}", self.kbpl)?;
        }
        write!(f, ",layout={}", layout_name(self.layout))
    }
}

fn number(field: &'static str, value: &str, limit: u32) -> Result<u32, SpecError> {
    let n: u64 = value.trim().parse().map_err(|_| SpecError::NotANumber {
        field,
        value: value.chars().take(32).collect(),
    })?;
    if n == 0 {
        return Err(SpecError::Zero { field });
    }
    if n > u64::from(limit) {
        return Err(SpecError::TooLarge {
            field,
            value: n,
            limit: limit.into(),
        });
    }
    Ok(n as u32)
}

impl FromStr for SideSpec {
    type Err = SpecError;

    fn from_str(text: &str) -> Result<Self, SpecError> {
        if text.trim().is_empty() {
            return Err(SpecError::Empty);
        }
        let (mut tp, mut pp, mut block, mut kbpl, mut layout) = (None, None, None, None, None);
        for item in text.split(',') {
            let Some((key, value)) = item.split_once('=') else {
                return Err(SpecError::NotAField {
                    item: item.chars().take(32).collect(),
                });
            };
            let key = key.trim().to_ascii_lowercase();
            let (field, slot, limit): (&'static str, &mut Option<u32>, u32) = match key.as_str() {
                "tp" => ("tp", &mut tp, MAX_PARALLEL),
                "pp" => ("pp", &mut pp, MAX_PARALLEL),
                "block" => ("block", &mut block, MAX_BLOCK_TOKENS),
                "kbpl" => ("kbpl", &mut kbpl, MAX_KBPL),
                "layout" => {
                    if layout.is_some() {
                        return Err(SpecError::Duplicate { field: "layout" });
                    }
                    layout = Some(match value.trim().to_ascii_uppercase().as_str() {
                        "NHD" => KvLayout::Nhd,
                        "HND" => KvLayout::Hnd,
                        _ => {
                            return Err(SpecError::BadLayout {
                                value: value.chars().take(32).collect(),
                            })
                        }
                    });
                    continue;
                }
                _ => {
                    return Err(SpecError::UnknownField {
                        field: key.chars().take(32).collect(),
                    })
                }
            };
            if slot.is_some() {
                return Err(SpecError::Duplicate { field });
            }
            *slot = Some(number(field, value, limit)?);
        }
        Ok(SideSpec {
            tp: tp.ok_or(SpecError::Missing { field: "tp" })?,
            pp: pp.unwrap_or(1),
            block: block.ok_or(SpecError::Missing { field: "block" })?,
            kbpl: kbpl.unwrap_or(1),
            layout: layout.ok_or(SpecError::Missing { field: "layout" })?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_field_in_any_order_and_case() {
        let s: SideSpec = "layout=nhd, kbpl=2 ,TP=8,pp=2,block=32".parse().unwrap();
        assert_eq!(
            s,
            SideSpec {
                tp: 8,
                pp: 2,
                block: 32,
                kbpl: 2,
                layout: KvLayout::Nhd
            }
        );
        assert_eq!(s.to_string(), "tp=8,pp=2,block=32,kbpl=2,layout=NHD");
        assert_eq!(s.to_string().parse::<SideSpec>().unwrap(), s);
        assert_eq!(s.logical_block(), 64);
    }

    #[test]
    fn each_bad_spec_names_its_field() {
        let cases: [(&str, SpecError); 9] = [
            ("", SpecError::Empty),
            (
                "tp=2,block",
                SpecError::NotAField {
                    item: "block".into(),
                },
            ),
            ("tp=2,dp=2", SpecError::UnknownField { field: "dp".into() }),
            ("tp=2,tp=4", SpecError::Duplicate { field: "tp" }),
            ("block=16,layout=HND", SpecError::Missing { field: "tp" }),
            (
                "tp=two,block=16,layout=HND",
                SpecError::NotANumber {
                    field: "tp",
                    value: "two".into(),
                },
            ),
            ("tp=0,block=16,layout=HND", SpecError::Zero { field: "tp" }),
            (
                "tp=2,block=99999999,layout=HND",
                SpecError::TooLarge {
                    field: "block",
                    value: 99_999_999,
                    limit: MAX_BLOCK_TOKENS.into(),
                },
            ),
            (
                "tp=2,block=16,layout=NDH",
                SpecError::BadLayout {
                    value: "NDH".into(),
                },
            ),
        ];
        for (text, want) in cases {
            assert_eq!(text.parse::<SideSpec>(), Err(want), "{text:?}");
        }
        let huge = format!("tp={},block=16,layout=HND", u64::MAX);
        assert!(matches!(
            huge.parse::<SideSpec>(),
            Err(SpecError::TooLarge { field: "tp", .. })
        ));
        assert!(matches!(
            "tp=-1,block=16,layout=HND".parse::<SideSpec>(),
            Err(SpecError::NotANumber { field: "tp", .. })
        ));
    }
}
