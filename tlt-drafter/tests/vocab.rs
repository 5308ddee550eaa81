//! Properties of the reduced draft vocabulary maps.
#![allow(clippy::unwrap_used)] // Tests: a panic is the failure report.

use proptest::prelude::*;
use tlt_drafter::VocabMap;

fn counts_and_n() -> impl Strategy<Value = (Vec<u64>, usize, Vec<u32>)> {
    (1usize..200).prop_flat_map(|vocab| {
        (
            prop::collection::vec(prop_oneof![3 => Just(0u64), 2 => 0u64..50], vocab),
            1..=vocab,
            prop::collection::vec(0..vocab as u32, 0..3),
        )
    })
}

proptest! {
    #[test]
    fn maps_are_consistent((counts, n, keep) in counts_and_n()) {
        prop_assume!({ let mut k = keep.clone(); k.sort_unstable(); k.dedup(); k.len() <= n });
        let m = VocabMap::from_counts(&counts, n, &keep).unwrap();
        let (d2t, t2d) = (m.d2t(), m.t2d());
        // d2t offsets map back to the used ids, which are strictly increasing.
        prop_assert_eq!(d2t.len(), n);
        for (i, off) in d2t.iter().enumerate() {
            prop_assert_eq!(i as i64 + off, m.used()[i] as i64);
            prop_assert_eq!(m.to_draft(m.used()[i]), Some(i));
        }
        prop_assert!(m.used().windows(2).all(|w| w[0] < w[1]));
        // t2d marks exactly N ids, the used ones.
        prop_assert_eq!(t2d.len(), counts.len());
        prop_assert_eq!(t2d.iter().filter(|&&b| b).count(), n);
        prop_assert!(m.used().iter().all(|&id| t2d[id as usize]));
        // Forced ids (EOS) are kept.
        prop_assert!(keep.iter().all(|&id| m.contains(id)));
        // Every id outside the map is at most as frequent as every non-forced id inside.
        let min_in = m.used().iter().filter(|id| !keep.contains(id)).map(|&id| counts[id as usize]).min();
        if let Some(min_in) = min_in {
            prop_assert!((0..counts.len() as u32).filter(|&j| !m.contains(j)).all(|j| counts[j as usize] <= min_in));
        }
        // Round trip through the checkpoint form.
        prop_assert_eq!(VocabMap::from_d2t(&d2t, Some(&t2d), counts.len()).unwrap(), m);
    }

    #[test]
    fn padding_uses_the_lowest_unseen_ids(seen in prop::collection::btree_set(0u32..64, 0..8), n in 8usize..20) {
        let mut counts = vec![0u64; 64];
        for &id in &seen {
            counts[id as usize] = 1 + id as u64;
        }
        let m = VocabMap::from_counts(&counts, n, &[]).unwrap();
        let padded: Vec<u32> = m.used().iter().copied().filter(|id| !seen.contains(id)).collect();
        let expected: Vec<u32> = (0..64).filter(|id| !seen.contains(id)).take(n - seen.len()).collect();
        prop_assert_eq!(padded, expected);
    }
}

#[test]
fn bad_requests_are_errors() {
    assert!(VocabMap::from_counts(&[1, 2, 3], 0, &[]).is_err());
    assert!(VocabMap::from_counts(&[1, 2, 3], 4, &[]).is_err());
    assert!(VocabMap::from_counts(&[1, 2, 3], 2, &[7]).is_err());
    assert!(VocabMap::from_counts(&[1, 2, 3], 1, &[0, 1]).is_err());
    assert!(VocabMap::from_tokens([0, 1, 5], 3, 2, &[]).is_err());
    let id = VocabMap::identity(5);
    assert!(id.is_identity());
    assert_eq!(id.d2t(), vec![0; 5]);
}
