//! Rendezvous (highest-random-weight) hashing of chunks onto targets.
//!
//! Every client ranks the live targets for a chunk by `BLAKE3(chunk hash ‖ target id)` and writes
//! to the first (and, with replication, the next R−1). All clients agree without coordination,
//! identical chunks from different ranks land on the same target (so deduplication works across
//! ranks), and adding or losing a target moves only the chunks that ranked it first.

use starckpt_proto::ChunkHash;

/// Indices into `target_ids`, best first, for `hash`.
pub fn rank_targets(hash: &ChunkHash, target_ids: &[&str]) -> Vec<usize> {
    let mut scored: Vec<(u64, usize)> = target_ids
        .iter()
        .enumerate()
        .map(|(index, id)| {
            let mut hasher = blake3::Hasher::new();
            hasher.update(&hash.0);
            hasher.update(id.as_bytes());
            let digest = hasher.finalize();
            let mut score = [0u8; 8];
            score.copy_from_slice(&digest.as_bytes()[..8]);
            (u64::from_le_bytes(score), index)
        })
        .collect();
    scored.sort_unstable_by(|a, b| b.cmp(a));
    scored.into_iter().map(|(_, index)| index).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_evenly_and_moves_little() {
        let ids = ["t-a", "t-b", "t-c"];
        let mut counts = [0usize; 3];
        let mut firsts = Vec::new();
        for i in 0..3000u32 {
            let hash = ChunkHash::of(&i.to_le_bytes());
            let order = rank_targets(&hash, &ids);
            assert_eq!(order.len(), 3);
            counts[order[0]] += 1;
            firsts.push((hash, ids[order[0]]));
        }
        for count in counts {
            assert!((800..1200).contains(&count), "uneven spread {counts:?}");
        }
        // Removing t-c moves only the chunks that ranked it first.
        let fewer = ["t-a", "t-b"];
        for (hash, first) in firsts {
            let now = fewer[rank_targets(&hash, &fewer)[0]];
            if first != "t-c" {
                assert_eq!(now, first);
            }
        }
    }
}
