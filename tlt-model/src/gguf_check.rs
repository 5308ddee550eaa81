//! What candle's GGUF header parser takes on trust, checked before it runs: a `general.alignment` it would
//! divide by (0) or llama.cpp refuses (not a power of two), and metadata arrays whose parsed form (one 32-byte
//! `Value` per element, where a `u8` element takes one byte on disk) would need more memory than the file
//! justifies. Only the metadata is walked, seeking past values; anything else malformed is left to candle's
//! parser, which reports it.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;

use crate::{Error, Result};

/// Parsed metadata may take at most this many times the file's size.
const MAX_EXPANSION: u64 = 16;
/// Nesting candle accepts for arrays of arrays.
const MAX_DEPTH: usize = 64;

/// Checks the header of the GGUF file behind `reader` (see the module docs) and rewinds it.
pub(crate) fn check_header(reader: &mut BufReader<File>, path: &Path) -> Result<()> {
    let io = |e| Error::io(path, e);
    let start = reader.stream_position().map_err(io)?;
    let size = reader.get_ref().metadata().map_err(io)?.len();
    let mut walk = Walk { r: reader, v1: false, elements: 0, alignment: None };
    // A header that does not walk to the end is candle's to report; what was seen up to there still counts.
    let _ = walk.header();
    let (elements, alignment) = (walk.elements, walk.alignment);
    reader.seek(SeekFrom::Start(start)).map_err(io)?;
    let bad = |reason: String| Err(Error::malformed(path, "gguf", reason));
    if let Some(a) = alignment.filter(|a| !a.is_power_of_two()) {
        return bad(format!("general.alignment = {a}: must be a positive power of two"));
    }
    let parsed = elements.saturating_mul(std::mem::size_of::<Value>() as u64);
    if parsed > size.saturating_mul(MAX_EXPANSION).max(1 << 20) {
        return bad(format!("{elements} metadata values would take {parsed} bytes parsed, for a {size}-byte file"));
    }
    Ok(())
}

/// A walk over the metadata: values seen (array elements included) and the alignment candle would use.
struct Walk<'a> {
    r: &'a mut BufReader<File>,
    v1: bool,
    elements: u64,
    alignment: Option<u64>,
}

impl Walk<'_> {
    fn read<const N: usize>(&mut self) -> Option<[u8; N]> {
        let mut b = [0u8; N];
        self.r.read_exact(&mut b).ok()?;
        Some(b)
    }

    fn len(&mut self) -> Option<u64> {
        if self.v1 {
            self.read::<4>().map(|b| u32::from_le_bytes(b) as u64)
        } else {
            self.read::<8>().map(u64::from_le_bytes)
        }
    }

    fn skip(&mut self, n: u64) -> Option<()> {
        self.r.seek_relative(i64::try_from(n).ok()?).ok()
    }

    fn header(&mut self) -> Option<()> {
        if self.read::<4>()? != *b"GGUF" {
            return None;
        }
        self.v1 = u32::from_le_bytes(self.read::<4>()?) == 1;
        let _tensors = self.len()?;
        for _ in 0..self.len()? {
            let n = self.len()?;
            let is_alignment = match usize::try_from(n).ok().filter(|&n| n <= 4096) {
                Some(n) => {
                    let mut key = vec![0u8; n];
                    self.r.read_exact(&mut key).ok()?;
                    // candle drops trailing NULs from strings.
                    key.iter().rposition(|&b| b != 0).map_or(&key[..0], |i| &key[..=i]) == b"general.alignment"
                }
                None => {
                    self.skip(n)?;
                    false
                }
            };
            let ty = u32::from_le_bytes(self.read::<4>()?);
            let int = self.value(ty, 0)?;
            if is_alignment {
                // The last one wins, as in candle's map; a non-integer one means the default.
                self.alignment = int;
            }
        }
        Some(())
    }

    /// Skips one value of GGUF type `ty`; returns it when it is an integer candle takes as an alignment
    /// (unsigned, or signed and not negative, of up to 32 bits).
    fn value(&mut self, ty: u32, depth: usize) -> Option<Option<u64>> {
        self.elements += 1;
        let int = |b: &[u8], signed: bool| -> Option<u64> {
            let v = b.iter().rev().fold(0u64, |v, &x| (v << 8) | x as u64);
            let negative = signed && b.last().is_some_and(|&x| x >= 0x80);
            (!negative).then_some(v)
        };
        Some(match ty {
            0 | 1 => int(&self.read::<1>()?, ty == 1),
            2 | 3 => int(&self.read::<2>()?, ty == 3),
            4 | 5 => int(&self.read::<4>()?, ty == 5),
            6 => self.skip(4).map(|()| None)?,
            7 => self.skip(1).map(|()| None)?,
            10..=12 => self.skip(8).map(|()| None)?,
            8 => {
                let n = self.len()?;
                self.skip(n).map(|()| None)?
            }
            9 if depth < MAX_DEPTH => {
                let elem = u32::from_le_bytes(self.read::<4>()?);
                let n = self.len()?;
                let fixed = match elem {
                    0 | 1 | 7 => Some(1u64),
                    2 | 3 => Some(2),
                    4..=6 => Some(4),
                    10..=12 => Some(8),
                    _ => None,
                };
                match fixed {
                    Some(size) => {
                        self.skip(n.checked_mul(size)?)?;
                        self.elements = self.elements.saturating_add(n);
                    }
                    None => {
                        for _ in 0..n {
                            self.value(elem, depth + 1)?;
                        }
                    }
                }
                None
            }
            _ => return None,
        })
    }
}
