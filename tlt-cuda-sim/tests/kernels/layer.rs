//! The decoder layer's row-wise and element-wise kernels (`layer.cu`) and the drafter's row concatenation
//! (`draft.cu`), executed in the simulated device with the host's launch plans, against CPU references; widths that
//! are not multiples of the block, several rows, grid-stride loops longer than the grid.

#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use crate::common::{bf16_ulp, round_bf16, to_bf16, to_f32, variants, worst, Rng};
use half::bf16;
use tlt_cuda_sim::SimDevice;
use tlt_kernels::cuda::plan::{self, RowBuf};

pub fn embed_rows_copies_table_rows(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, width, vocab) in [(1, 1, 1), (3, 257, 11), (17, 576, 40)] {
            let mut rng = Rng::new(rows as u64 * 31 + width as u64);
            let table = to_bf16(&rng.vec(vocab * width, -2.0, 2.0));
            let tokens: Vec<i32> = (0..rows).map(|_| rng.below(vocab) as i32).collect();
            let (t, k, x) = (dev.upload(&table), dev.upload(&tokens), dev.zeros::<f32>(rows * width));
            dev.launch(&plan::embed_rows(rows, width, t.buf(), k.buf(), x.buf()).unwrap()).unwrap();
            let want: Vec<f32> =
                tokens.iter().flat_map(|&tok| to_f32(&table[tok as usize * width..][..width])).collect();
            assert_eq!(x.download(), want, "{order}: embed {rows}x{width}");
        }
    }
    println!("embed_rows_bf16: rows x width x vocab 1x1x1, 3x257x11, 17x576x40");
}

/// RMSNorm of f32 rows times a bf16 weight, in f64.
fn rms_ref(x: &[f32], w: &[f32], width: usize, eps: f32) -> Vec<f32> {
    x.chunks(width)
        .flat_map(|r| {
            let ms = r.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / width as f64;
            let inv = 1.0 / (ms + f64::from(eps)).sqrt();
            r.iter().zip(w).map(move |(&v, &g)| (f64::from(v) * inv * f64::from(g)) as f32).collect::<Vec<_>>()
        })
        .collect()
}

pub fn rms_norm_rows_match_f64(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, width) in [(1, 1), (2, 64), (5, 255), (3, 576), (2, 4096)] {
            let mut rng = Rng::new(width as u64);
            let x = rng.vec(rows * width, -3.0, 3.0);
            let w = round_bf16(&rng.vec(width, 0.5, 1.5));
            let (xb, wb, out) = (dev.upload(&x), dev.upload(&to_bf16(&w)), dev.zeros::<bf16>(rows * width));
            dev.launch(&plan::rms_norm(rows, width, 1e-5, xb.buf(), wb.buf(), out.buf()).unwrap()).unwrap();
            let want = rms_ref(&x, &w, width, 1e-5);
            let (e, i) = worst(&to_f32(&out.download()), &want, |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: rms_norm {rows}x{width}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("rms_norm_bf16: rows x width 1x1, 2x64, 5x255, 3x576, 2x4096");
}

pub fn head_rms_norm_normalises_every_head_vector_in_place(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        // Vectors not a multiple of the 8 warps of a block; head dims below, at and above a warp.
        for (vectors, hd) in [(1, 8), (9, 32), (13, 64), (24, 128)] {
            let mut rng = Rng::new(vectors as u64 * 7 + hd as u64);
            let x = round_bf16(&rng.vec(vectors * hd, -2.0, 2.0));
            let w = round_bf16(&rng.vec(hd, 0.5, 1.5));
            let (xb, wb) = (dev.upload(&to_bf16(&x)), dev.upload(&to_bf16(&w)));
            dev.launch(&plan::head_rms_norm(hd, 1e-6, xb.buf(), wb.buf()).unwrap().unwrap()).unwrap();
            let want = rms_ref(&x, &w, hd, 1e-6);
            let (e, i) = worst(&to_f32(&xb.download()), &want, |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: head_rms_norm {vectors}x{hd}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("head_rms_norm_bf16: vectors x head_dim 1x8, 9x32, 13x64, 24x128");
}

pub fn element_wise_kernels_cover_every_element(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        // 2,000,000 elements need 7,813 blocks of 256: the grid is capped at 4,096 and the loops stride.
        for n in [1, 255, 257, 2_000_000] {
            let mut rng = Rng::new(n as u64);
            let x = rng.vec(n, -4.0, 4.0);
            let y = round_bf16(&rng.vec(n, -4.0, 4.0));
            let (xb, yb) = (dev.upload(&x), dev.upload(&to_bf16(&y)));
            dev.launch(&plan::add_to_residual(xb.buf(), yb.buf()).unwrap()).unwrap();
            let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
            assert_eq!(xb.download(), want, "{order}: add n = {n}");

            let gate = round_bf16(&rng.vec(n, -6.0, 6.0));
            let gb = dev.upload(&to_bf16(&gate));
            dev.launch(&plan::silu_mul(gb.buf(), yb.buf()).unwrap()).unwrap();
            let want: Vec<f32> = gate
                .iter()
                .zip(&y)
                .map(|(&g, &u)| (f64::from(g) / (1.0 + (-f64::from(g)).exp()) * f64::from(u)) as f32)
                .collect();
            let (e, i) = worst(&to_f32(&gb.download()), &want, |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: silu_mul n = {n}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("add_bf16_to_f32, silu_mul_bf16: n = 1, 255, 257, 2,000,000 (grid-stride past 4,096 blocks)");
}

pub fn bias_add_adds_the_bias_to_every_row(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, cols) in [(1, 1), (3, 100), (64, 1536)] {
            let mut rng = Rng::new(cols as u64);
            let y = round_bf16(&rng.vec(rows * cols, -2.0, 2.0));
            let b = round_bf16(&rng.vec(cols, -1.0, 1.0));
            let (yb, bb) = (dev.upload(&to_bf16(&y)), dev.upload(&to_bf16(&b)));
            dev.launch(&plan::bias_add(rows, yb.buf(), bb.buf()).unwrap()).unwrap();
            let want = round_bf16(&y.iter().enumerate().map(|(i, &v)| v + b[i % cols]).collect::<Vec<_>>());
            assert_eq!(to_f32(&yb.download()), want, "{order}: bias_add {rows}x{cols}");
        }
    }
    println!("bias_add_bf16: rows x cols 1x1, 3x100, 64x1536");
}

/// The SplitMix64 hash `fill_uniform_bf16` documents, in Rust.
fn uniform_ref(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = seed.wrapping_add((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
            bf16::from_f32(lo + (hi - lo) * u).to_f32()
        })
        .collect()
}

pub fn fill_uniform_is_the_documented_hash(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (n, seed) in [(1, 0), (1000, 7), (1_500_000, u64::MAX)] {
            let out = dev.zeros::<bf16>(n);
            dev.launch(&plan::fill_uniform(out.buf(), seed, -0.5, 0.25).unwrap()).unwrap();
            let got = to_f32(&out.download());
            assert_eq!(got, uniform_ref(n, seed, -0.5, 0.25), "{order}: fill n = {n}");
            assert!(got.iter().all(|v| (-0.5..=0.25).contains(v)));
        }
    }
    println!("fill_uniform_bf16: n = 1, 1000, 1,500,000");
}

pub fn concat_rows_joins_f32_and_bf16_sources(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, wa, wb) in [(1, 1, 0), (3, 64, 64), (5, 300, 257)] {
            let mut rng = Rng::new(rows as u64 + wa as u64);
            let a = rng.vec(rows * wa, -3.0, 3.0);
            let b = round_bf16(&rng.vec(rows * wb, -3.0, 3.0));
            let (a32, a16) = (dev.upload(&a), dev.upload(&to_bf16(&a)));
            let (b32, b16) = (dev.upload(&b), dev.upload(&to_bf16(&b)));
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| {
                    let mut row = round_bf16(&a[r * wa..][..wa]);
                    row.extend_from_slice(&b[r * wb..][..wb]);
                    row
                })
                .collect();
            let sources = [
                (RowBuf::F32(a32.buf(), wa), Some(RowBuf::Bf16(b16.buf(), wb))),
                (RowBuf::Bf16(a16.buf(), wa), Some(RowBuf::F32(b32.buf(), wb))),
            ];
            for (sa, sb) in sources {
                let sb = if wb == 0 { None } else { sb };
                let out = dev.zeros::<bf16>(rows * (wa + wb));
                dev.launch(&plan::concat_rows(rows, sa, sb, out.buf()).unwrap()).unwrap();
                assert_eq!(to_f32(&out.download()), want, "{order}: concat {rows}x({wa}+{wb})");
            }
        }
    }
    println!("concat_rows_bf16: rows x (wa + wb) 1x(1+0), 3x(64+64), 5x(300+257), f32/bf16 on either side");
}

pub fn add_rms_norm_adds_the_residual_then_normalises(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, width) in [(1, 1), (3, 576), (2, 4096)] {
            let mut rng = Rng::new(width as u64 + 9);
            let x = rng.vec(rows * width, -3.0, 3.0);
            let y = round_bf16(&rng.vec(rows * width, -1.0, 1.0));
            let w = round_bf16(&rng.vec(width, 0.5, 1.5));
            let (xb, yb, wb) = (dev.upload(&x), dev.upload(&to_bf16(&y)), dev.upload(&to_bf16(&w)));
            let out = dev.zeros::<bf16>(rows * width);
            let l = plan::add_rms_norm(rows, width, 1e-5, xb.buf(), yb.buf(), wb.buf(), out.buf()).unwrap();
            dev.launch(&l).unwrap();
            let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
            assert_eq!(xb.download(), sum, "{order}: the residual {rows}x{width}");
            let (e, i) = worst(&to_f32(&out.download()), &rms_ref(&sum, &w, width, 1e-5), |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: add_rms_norm {rows}x{width}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("add_rms_norm_bf16: rows x width 1x1, 3x576, 2x4096");
}

pub fn silu_mul_packed_reads_gate_and_up_from_one_row(dev: &SimDevice) {
    for (order, dev) in variants(dev) {
        for (rows, inter) in [(1, 1), (3, 1536), (700, 3000)] {
            let mut rng = Rng::new(inter as u64);
            let gu = round_bf16(&rng.vec(rows * 2 * inter, -6.0, 6.0));
            let (gb, out) = (dev.upload(&to_bf16(&gu)), dev.zeros::<bf16>(rows * inter));
            dev.launch(&plan::silu_mul_packed(rows, inter, gb.buf(), out.buf()).unwrap()).unwrap();
            let want: Vec<f32> = (0..rows * inter)
                .map(|k| {
                    let (r, j) = (k / inter, k % inter);
                    let (g, u) = (f64::from(gu[r * 2 * inter + j]), f64::from(gu[r * 2 * inter + inter + j]));
                    (g / (1.0 + (-g).exp()) * u) as f32
                })
                .collect();
            let (e, i) = worst(&to_f32(&out.download()), &want, |_, v| bf16_ulp(v, 1e-3));
            assert!(e <= 1.0, "{order}: silu_mul_packed {rows}x{inter}: element {i} off by {e} bf16 ulps");
        }
    }
    println!("silu_mul_packed_bf16: rows x intermediate 1x1, 3x1536, 700x3000 (grid-stride past 4,096 blocks)");
}

kernel_tests!(
    embed_rows_copies_table_rows => [embed_rows_bf16],
    rms_norm_rows_match_f64 => [rms_norm_bf16],
    head_rms_norm_normalises_every_head_vector_in_place => [head_rms_norm_bf16],
    element_wise_kernels_cover_every_element => [add_bf16_to_f32, silu_mul_bf16],
    bias_add_adds_the_bias_to_every_row => [bias_add_bf16],
    fill_uniform_is_the_documented_hash => [fill_uniform_bf16],
    concat_rows_joins_f32_and_bf16_sources => [concat_rows_bf16],
    add_rms_norm_adds_the_residual_then_normalises => [add_rms_norm_bf16],
    silu_mul_packed_reads_gate_and_up_from_one_row => [silu_mul_packed_bf16],
);
