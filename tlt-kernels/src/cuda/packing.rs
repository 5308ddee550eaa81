//! Packed transfers: several small arrays in one buffer, so a step sends its inputs in one host-to-device copy from
//! a pinned staging buffer and reads its results back in one copy. [`Packing`] lays the arrays out (each segment
//! 16-byte aligned, the alignment of our kernels' vector loads) and reads and writes them in host bytes; the device
//! side addresses the same segments as [`Buf`]s. Host-side, no CUDA needed (the simulator runs kernels on packed
//! buffers in CI).

use bytemuck::Pod;

use super::plan::Buf;
use crate::error::{Error, Result};

/// Alignment of every segment, in bytes.
pub const PACK_ALIGN: usize = 16;

/// The layout of one packed buffer: segment `i` holds `bytes[i]` bytes at a [`PACK_ALIGN`]-aligned offset.
///
/// ```
/// use tlt_kernels::cuda::packing::Packing;
/// let p = Packing::new(&[3 * 4, 2 * 8]); // three i32, then two f64
/// let mut host = vec![0u8; p.bytes()];
/// p.put(&mut host, 0, &[1i32, 2], -1).unwrap(); // padded with -1
/// p.put(&mut host, 1, &[0.5f64, 0.25], 0.0).unwrap();
/// assert_eq!(p.get::<i32>(&host, 0).unwrap(), [1, 2, -1]);
/// assert_eq!(p.get::<f64>(&host, 1).unwrap(), [0.5, 0.25]);
/// assert_eq!(p.bytes(), 32);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    /// `(offset, bytes)` of every segment.
    segs: Vec<(usize, usize)>,
    bytes: usize,
}

impl Packing {
    /// Segments of `bytes[i]` bytes, in order.
    #[must_use]
    pub fn new(bytes: &[usize]) -> Self {
        let mut at = 0;
        let segs = bytes
            .iter()
            .map(|&b| {
                let seg = (at, b);
                at = (at + b).next_multiple_of(PACK_ALIGN);
                seg
            })
            .collect();
        Self { segs, bytes: at }
    }

    /// Bytes of the whole buffer (a multiple of [`PACK_ALIGN`]).
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes up to the end of segment `seg` (a prefix to copy when the later segments are not needed).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a segment that does not exist.
    pub fn end_of(&self, seg: usize) -> Result<usize> {
        self.seg(seg).map(|(o, b)| o + b)
    }

    fn seg(&self, seg: usize) -> Result<(usize, usize)> {
        self.segs
            .get(seg)
            .copied()
            .ok_or_else(|| Error::InvalidArgument(format!("segment {seg} of a packing of {}", self.segs.len())))
    }

    fn typed<T>(&self, seg: usize) -> Result<(usize, usize)> {
        let (offset, bytes) = self.seg(seg)?;
        let size = std::mem::size_of::<T>();
        if size == 0 || bytes % size != 0 {
            return Err(Error::InvalidArgument(format!(
                "segment {seg} holds {bytes} bytes, not a whole number of {}",
                std::any::type_name::<T>()
            )));
        }
        Ok((offset, bytes / size))
    }

    /// Segment `seg` of the packed buffer `base` (device or simulated memory) as a buffer of `T`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing segment, one that is not a whole number of `T`, or a `base` shorter
    /// than the packing.
    pub fn buf<T>(&self, base: Buf<u8>, seg: usize) -> Result<Buf<T>> {
        if base.len() < self.bytes {
            return Err(Error::InvalidArgument(format!(
                "a packed buffer of {} bytes, {} needed",
                base.len(),
                self.bytes
            )));
        }
        let (offset, len) = self.typed::<T>(seg)?;
        Ok(Buf::new(base.addr() + offset as u64, len))
    }

    /// Writes `values` into segment `seg` of the host bytes `host`, the rest of the segment with `fill`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a missing segment, more values than it holds, or `host` shorter than the
    /// packing.
    pub fn put<T: Pod>(&self, host: &mut [u8], seg: usize, values: &[T], fill: T) -> Result<()> {
        let (offset, len) = self.typed::<T>(seg)?;
        if values.len() > len || host.len() < self.bytes {
            return Err(Error::InvalidArgument(format!(
                "{} values into segment {seg} of {len} ({} host bytes of {})",
                values.len(),
                host.len(),
                self.bytes
            )));
        }
        let size = std::mem::size_of::<T>();
        let (data, rest) = host[offset..offset + len * size].split_at_mut(std::mem::size_of_val(values));
        data.copy_from_slice(bytemuck::cast_slice(values));
        for chunk in rest.chunks_exact_mut(size) {
            chunk.copy_from_slice(bytemuck::bytes_of(&fill));
        }
        Ok(())
    }

    /// Segment `seg` of the host bytes `host`, as values.
    ///
    /// # Errors
    /// As [`Packing::put`].
    pub fn get<T: Pod>(&self, host: &[u8], seg: usize) -> Result<Vec<T>> {
        let (offset, len) = self.typed::<T>(seg)?;
        let bytes = host
            .get(offset..offset + len * std::mem::size_of::<T>())
            .ok_or_else(|| Error::InvalidArgument(format!("segment {seg} lies past the {} host bytes", host.len())))?;
        Ok(bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Segments are aligned, disjoint, in order and inside the buffer, and what is put is what is got.
        #[test]
        fn segments_are_aligned_disjoint_and_round_trip(lens in proptest::collection::vec(0usize..40, 1..8)) {
            let p = Packing::new(&lens.iter().map(|n| n * 4).collect::<Vec<_>>());
            let mut host = vec![0xAAu8; p.bytes()];
            let mut end = 0;
            for (i, &n) in lens.iter().enumerate() {
                let (o, b) = p.seg(i).unwrap();
                prop_assert!(o.is_multiple_of(PACK_ALIGN));
                prop_assert!(o >= end);
                end = o + b;
                let v: Vec<i32> = (0..n as i32).map(|k| k * 7 - i as i32).collect();
                p.put(&mut host, i, &v[..n / 2], -5).unwrap();
            }
            prop_assert!(end <= p.bytes() && p.bytes().is_multiple_of(PACK_ALIGN));
            for (i, &n) in lens.iter().enumerate() {
                let got = p.get::<i32>(&host, i).unwrap();
                let want: Vec<i32> = (0..n as i32).map(|k| if (k as usize) < n / 2 { k * 7 - i as i32 } else { -5 }).collect();
                prop_assert_eq!(got, want);
                let b = p.buf::<i32>(Buf::new(4096, p.bytes()), i).unwrap();
                prop_assert_eq!((b.addr() - 4096) as usize, p.seg(i).unwrap().0);
                prop_assert_eq!(b.len(), n);
            }
        }
    }

    #[test]
    fn bad_segments_are_errors() {
        let p = Packing::new(&[12, 6]);
        let mut host = vec![0u8; p.bytes()];
        assert!(p.put(&mut host, 0, &[1i32, 2, 3, 4], 0).is_err(), "too many values");
        assert!(p.put(&mut host, 2, &[1i32], 0).is_err(), "no segment 2");
        assert!(p.get::<i32>(&host, 1).is_err(), "6 bytes are not i32s");
        assert!(p.get::<i32>(&host[..8], 0).is_err(), "host too short");
        assert!(p.buf::<i32>(Buf::new(0, 8), 0).is_err(), "device buffer too short");
        assert_eq!(p.end_of(1).unwrap(), 22);
    }
}
