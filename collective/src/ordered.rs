//! The rank-order sum on the host: the reference the NCCL communicator's all-reduce kernel
//! (`collective/cuda/ordered_sum.cu`) must match bit for bit, and the sum the `local`
//! communicator computes.
//!
//! A gathered buffer is rank-major: `world` rows of `n` elements, rank `r`'s contribution at
//! `gathered[r * n..(r + 1) * n]`. Element `i` of the sum is `((g₀[i] + g₁[i]) + g₂[i]) + …` in
//! f32, starting from rank 0's value. bf16 buffers are widened to f32 (exact), added in the same
//! order in f32, and rounded to bf16 once, to nearest even.

use half::bf16;

/// `out[i] = ((g₀[i] + g₁[i]) + …) + gₙ₋₁[i]` in f32. `gathered.len()` must be
/// `world * out.len()` with `world ≥ 1`; otherwise this panics (a caller's bug: the lengths are
/// the caller's own).
pub fn ordered_sum_f32(gathered: &[f32], world: usize, out: &mut [f32]) {
    let n = out.len();
    assert!(
        world >= 1 && gathered.len() == world * n,
        "ordered_sum_f32: {} gathered elements for {world} ranks of {n}",
        gathered.len()
    );
    out.copy_from_slice(&gathered[..n]);
    for row in gathered.chunks_exact(n.max(1)).skip(1).take(world - 1) {
        for (acc, x) in out.iter_mut().zip(row) {
            *acc += *x;
        }
    }
}

/// The bf16 rank-order sum: each element widened to f32, added in rank order in f32, rounded to
/// bf16 once ([`round_to_bf16`]). Same length rules as [`ordered_sum_f32`].
pub fn ordered_sum_bf16(gathered: &[bf16], world: usize, out: &mut [bf16]) {
    let n = out.len();
    assert!(
        world >= 1 && gathered.len() == world * n,
        "ordered_sum_bf16: {} gathered elements for {world} ranks of {n}",
        gathered.len()
    );
    for (i, o) in out.iter_mut().enumerate() {
        let mut acc = gathered[i].to_f32();
        for r in 1..world {
            acc += gathered[r * n + i].to_f32();
        }
        *o = round_to_bf16(acc);
    }
}

/// f32 → bf16, round to nearest even; a NaN keeps its sign and top payload bits and is made quiet.
/// Written out in integer arithmetic, as the kernel does, so both agree on every input.
pub fn round_to_bf16(x: f32) -> bf16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return bf16::from_bits(((u >> 16) | 0x0040) as u16);
    }
    let rounded = u.wrapping_add(0x7fff + ((u >> 16) & 1));
    bf16::from_bits((rounded >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Communicator, LocalGroup};

    fn bits(xs: &[f32]) -> Vec<u32> {
        xs.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn the_sum_is_taken_in_rank_order() {
        // Rank order: (1e8 + 1) + -1e8 = 0 in f32 (1 is lost), where (1e8 + -1e8) + 1 would be 1.
        let gathered = [1e8f32, 1.0, -1e8];
        let mut out = [f32::NAN];
        ordered_sum_f32(&gathered, 3, &mut out);
        assert_eq!(out[0], 0.0);
        let reordered = [1e8f32, -1e8, 1.0];
        ordered_sum_f32(&reordered, 3, &mut out);
        assert_eq!(out[0], 1.0, "the canary: another order gives another sum");
    }

    #[test]
    fn the_sum_starts_from_rank_zeros_value_so_negative_zero_survives() {
        let mut out = [0.0f32; 2];
        ordered_sum_f32(&[-0.0, 3.5, -0.0, -0.0], 2, &mut out);
        assert_eq!(bits(&out), bits(&[-0.0, 3.5]));
        // Starting from +0.0 would have given +0.0 for the first element.
        assert_ne!((0.0f32 + -0.0 + -0.0).to_bits(), out[0].to_bits());
    }

    #[test]
    fn one_rank_is_the_identity_and_empty_buffers_are_fine() {
        let xs = [
            1.5f32,
            -0.0,
            f32::INFINITY,
            f32::from_bits(0x7fc0_1234),
            1e-45,
        ];
        let mut out = [0.0f32; 5];
        ordered_sum_f32(&xs, 1, &mut out);
        assert_eq!(bits(&out), bits(&xs));
        ordered_sum_f32(&[], 4, &mut []);
        ordered_sum_bf16(&[], 4, &mut []);
    }

    #[test]
    fn denormals_are_added_not_flushed() {
        let tiny = f32::from_bits(1);
        let mut out = [0.0f32];
        ordered_sum_f32(&[tiny, tiny], 2, &mut out);
        assert_eq!(out[0].to_bits(), 2);
    }

    #[test]
    fn bf16_sums_in_f32_and_rounds_once() {
        // 256 + 1 + 1 in bf16 steps would round 257 back to 256 twice; in f32 it is 258, exact
        // in bf16.
        let g: Vec<bf16> = [256.0f32, 1.0, 1.0].map(bf16::from_f32).to_vec();
        let mut out = [bf16::ZERO];
        ordered_sum_bf16(&g, 3, &mut out);
        assert_eq!(out[0].to_f32(), 258.0);
        // -0.0 from every rank stays -0.0.
        let g = [bf16::NEG_ZERO; 3];
        ordered_sum_bf16(&g, 3, &mut out);
        assert_eq!(out[0].to_bits(), bf16::NEG_ZERO.to_bits());
    }

    #[test]
    fn rounding_matches_the_half_crate_including_ties_and_nans() {
        let mut cases = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // signalling NaN
            f32::from_bits(0x3f80_8000), // tie, even below: rounds down
            f32::from_bits(0x3f81_8000), // tie, odd below: rounds up
            f32::from_bits(0x3f80_8001), // just above a tie
            f32::from_bits(0x7f7f_ffff), // rounds to infinity
            f32::from_bits(0x0000_8000), // denormal tie
        ];
        // A sweep over exponents and mantissas.
        let mut state = 0x9e37_79b9u32;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            cases.push(f32::from_bits(state));
        }
        for x in cases {
            assert_eq!(
                round_to_bf16(x).to_bits(),
                bf16::from_f32(x).to_bits(),
                "{x:e} ({:#010x})",
                x.to_bits()
            );
        }
    }

    /// The `local` communicator and this reference agree bit for bit: the NCCL kernel is checked
    /// against this function on the GPU, so all three compute the same sum.
    #[test]
    fn the_local_communicator_computes_the_reference_sum() {
        let world = 4;
        let n = 257;
        let contribution = |rank: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let v = ((i * 7919 + rank * 104_729) % 2003) as f32 - 1001.0;
                    v * 10f32.powi((i % 9) as i32 - 4)
                })
                .collect()
        };
        let gathered: Vec<f32> = (0..world).flat_map(contribution).collect();
        let mut want = vec![0.0f32; n];
        ordered_sum_f32(&gathered, world, &mut want);

        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalGroup::new(world)
                .into_iter()
                .map(|comm| {
                    s.spawn(move || {
                        let mut buf = contribution(comm.rank());
                        comm.all_reduce_sum_f32(&mut buf).map(|()| buf)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("rank thread").expect("all-reduce"))
                .collect()
        });
        for got in results {
            assert_eq!(bits(&got), bits(&want));
        }
    }
}
