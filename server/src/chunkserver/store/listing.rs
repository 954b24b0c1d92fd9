//! Listing a store's chunks in hash order, page by page, over its fan-out directories.

use super::*;

/// `unreadable` is told of each fan-out directory that cannot be listed and each chunk file that
/// cannot be stat'ed: Ok leaves it out and goes on, Err ends the listing with that error.
pub(super) fn list_chunks(
    chunks: &Path,
    clock: &UseClock,
    after: Option<ChunkHash>,
    limit: usize,
    unreadable: &mut dyn FnMut(ChunkStoreError) -> Result<(), ChunkStoreError>,
) -> Result<(Vec<ListedChunk>, bool), ChunkStoreError> {
    let mut page = Vec::new();
    for byte in after.map_or(0, |h| h.0[0])..=255u8 {
        // A full page ends before the next directory, not in it: the next page starts in the
        // directory of this one's last chunk, so no directory is read (or found unreadable) by
        // two pages. Chunks may or may not follow.
        if page.len() == limit {
            return Ok((page, false));
        }
        let dir = chunks.join(format!("{byte:02x}"));
        let mut hashes = Vec::new();
        let listed = std::fs::read_dir(&dir).and_then(|entries| {
            for entry in entries {
                // Anything that is not a chunk name (an operator's stray file) is not ours to list.
                let Some(hash) = entry?.file_name().to_str().and_then(|name| ChunkHash::from_hex(name).ok()) else {
                    continue;
                };
                if after.is_none_or(|after| hash > after) {
                    hashes.push(hash);
                }
            }
            Ok(())
        });
        if let Err(source) = listed {
            unreadable(ChunkStoreError::Io { op: "list", path: dir, source })?;
            continue;
        }
        hashes.sort_unstable();
        for hash in hashes {
            if page.len() == limit {
                return Ok((page, false));
            }
            let path = dir.join(hash.to_hex());
            let last_use = match std::fs::metadata(&path).and_then(|meta| meta.modified()) {
                Ok(modified) => modified,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => {
                    unreadable(ChunkStoreError::Io { op: "stat", path, source })?;
                    continue;
                }
            };
            page.push(ListedChunk { hash, unused_for: clock.unused_for(last_use) });
        }
    }
    Ok((page, true))
}
