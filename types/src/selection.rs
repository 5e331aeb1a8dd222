//! Selections as every backend sees them, and their one normalization into spans
//! (docs/nsa.md, "Selections").

/// The selected keys of every (query token, kv head) row, row = `token * hkv + head`, with key
/// positions relative to the row's own sequence. `I` is where the i32 entries live: a host
/// slice or vector here, a device view in the CUDA backend.
///
/// ```
/// use fp8nsa_types::Spans;
/// // Row 0 selects blocks 2 and 0 (and one pad), block size 4.
/// let sel = Spans::Blocks { indices: vec![2, -1, 0], per_row: 3, block_size: 4 };
/// let mut spans = Vec::new();
/// sel.row_spans(0, 10, &mut spans);
/// assert_eq!(spans, [(0, 4), (8, 10)]); // sorted, and clamped to the 10 visible keys
/// assert_eq!(sel.rows(), 1);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spans<I> {
    /// `indices [rows, per_row]`: block ids (negative = padding); block `i` is
    /// `[i * block_size, (i + 1) * block_size)`.
    Blocks {
        indices: I,
        per_row: usize,
        block_size: usize,
    },
    /// `ranges [rows, per_row, 2]`: half-open `[start, end)`; `end <= start` is padding.
    Ranges { ranges: I, per_row: usize },
}

/// Why one entry of a row breaks the selection contract: `entry` is its index in the row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryIssue {
    pub entry: usize,
    pub msg: String,
}

impl<I> Spans<I> {
    /// Entries per row (blocks or ranges).
    pub fn per_row(&self) -> usize {
        match *self {
            Spans::Blocks { per_row, .. } | Spans::Ranges { per_row, .. } => per_row,
        }
    }

    /// i32 values per row: `per_row` for blocks, `2 * per_row` for ranges.
    pub fn row_width(&self) -> usize {
        match *self {
            Spans::Blocks { per_row, .. } => per_row,
            Spans::Ranges { per_row, .. } => 2 * per_row,
        }
    }

    /// The entries' storage.
    pub fn data(&self) -> &I {
        match self {
            Spans::Blocks { indices, .. } => indices,
            Spans::Ranges { ranges, .. } => ranges,
        }
    }

    /// The same selection with its entries in another storage (uploaded, borrowed, ...).
    pub fn map<J>(self, f: impl FnOnce(I) -> J) -> Spans<J> {
        match self {
            Spans::Blocks {
                indices,
                per_row,
                block_size,
            } => Spans::Blocks {
                indices: f(indices),
                per_row,
                block_size,
            },
            Spans::Ranges { ranges, per_row } => Spans::Ranges {
                ranges: f(ranges),
                per_row,
            },
        }
    }
}

impl<I: AsRef<[i32]>> Spans<I> {
    /// Borrowed entries.
    pub fn as_slice(&self) -> Spans<&[i32]> {
        match self {
            Spans::Blocks {
                indices,
                per_row,
                block_size,
            } => Spans::Blocks {
                indices: indices.as_ref(),
                per_row: *per_row,
                block_size: *block_size,
            },
            Spans::Ranges { ranges, per_row } => Spans::Ranges {
                ranges: ranges.as_ref(),
                per_row: *per_row,
            },
        }
    }

    /// Rows held (0 when a row has no entries).
    pub fn rows(&self) -> usize {
        match self.row_width() {
            0 => 0,
            w => self.data().as_ref().len() / w,
        }
    }

    /// Row `row`'s entries as `(entry, start, end)` key positions, padding left out, without
    /// any clamp (i64, so no entry overflows).
    fn entries(&self, row: usize) -> impl Iterator<Item = (usize, i64, i64)> + '_ {
        let w = self.row_width();
        let data = &self.data().as_ref()[row * w..(row + 1) * w];
        let (blocks, ranges) = match *self {
            Spans::Blocks { block_size, .. } => (Some((data, block_size as i64)), None),
            Spans::Ranges { .. } => (None, Some(data)),
        };
        let blocks = blocks.into_iter().flat_map(|(d, bs)| {
            d.iter()
                .enumerate()
                .filter(|(_, &i)| i >= 0)
                .map(move |(e, &i)| (e, i as i64 * bs, (i as i64 + 1) * bs))
        });
        let ranges = ranges.into_iter().flat_map(|d| {
            d.chunks_exact(2)
                .enumerate()
                .map(|(e, r)| (e, r[0] as i64, r[1] as i64))
                .filter(|&(_, a, b)| b > a)
        });
        blocks.chain(ranges)
    }

    /// Row `row`'s selected keys clamped to `[0, limit)`, sorted and merged into disjoint
    /// half-open spans, into `out`: whatever the entries say, nothing outside `[0, limit)` is
    /// named and every key appears at most once. This is the normalization every host path
    /// uses (the CUDA kernel does the same on the device).
    pub fn row_spans(&self, row: usize, limit: usize, out: &mut Vec<(usize, usize)>) {
        out.clear();
        if self.per_row() == 0 {
            return;
        }
        let clamp = |x: i64| x.clamp(0, limit as i64) as usize;
        out.extend(self.entries(row).map(|(_, a, b)| (clamp(a), clamp(b))));
        out.retain(|&(a, b)| b > a);
        out.sort_unstable();
        let mut merged = 0;
        for i in 0..out.len() {
            if merged > 0 && out[i].0 <= out[merged - 1].1 {
                out[merged - 1].1 = out[merged - 1].1.max(out[i].1);
            } else {
                out[merged] = out[i];
                merged += 1;
            }
        }
        out.truncate(merged);
    }

    /// Checks row `row` against the contract for a sequence of `tk` keys: block ids are `-1`
    /// (padding) or start on a key; ranges that are not padding start inside `[0, tk)`; no two
    /// entries share a key. A range may end past `tk` (it is clamped, like a partial last
    /// block). The first problem found is returned, naming its entry.
    ///
    /// ```
    /// use fp8nsa_types::Spans;
    /// let dup = Spans::Blocks { indices: [1, 1], per_row: 2, block_size: 64 };
    /// assert_eq!(dup.check_row(0, 128).unwrap_err().entry, 1);
    /// let ok = Spans::Ranges { ranges: [0, 3, 3, 500], per_row: 2 };
    /// assert!(ok.check_row(0, 10).is_ok());
    /// ```
    pub fn check_row(&self, row: usize, tk: usize) -> Result<(), EntryIssue> {
        let tk = tk as i64;
        let w = self.row_width();
        let data = &self.data().as_ref()[row * w..(row + 1) * w];
        let issue = |entry: usize, msg: String| Err(EntryIssue { entry, msg });
        let mut spans: Vec<(i64, i64, usize)> = Vec::with_capacity(self.per_row());
        match *self {
            Spans::Blocks { block_size, .. } => {
                let bs = block_size as i64;
                for (e, &i) in data.iter().enumerate() {
                    if i == -1 {
                        continue;
                    }
                    if i < -1 {
                        return issue(e, format!("block index {i}: only -1 pads"));
                    }
                    let a = i as i64 * bs;
                    if a >= tk {
                        return issue(e, format!("block {i} starts at key {a}, past tk = {tk}"));
                    }
                    spans.push((a, a + bs, e));
                }
            }
            Spans::Ranges { .. } => {
                for (e, a, b) in self.entries(row) {
                    if a < 0 || a >= tk {
                        return issue(e, format!("range [{a}, {b}) starts outside [0, tk = {tk})"));
                    }
                    spans.push((a, b, e));
                }
            }
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            let ((a0, b0, e0), (a1, _, e1)) = (w[0], w[1]);
            if a1 < b0 {
                let what = if a0 == a1 { "duplicates" } else { "overlaps" };
                return Err(EntryIssue {
                    entry: e1.max(e0),
                    msg: format!("{what} entry {}", e1.min(e0)),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every key of `[0, limit)` named by some entry, counted once: the definition the spans
    /// must agree with.
    fn keys(sel: &Spans<Vec<i32>>, row: usize, limit: usize) -> Vec<usize> {
        let mut keys: Vec<usize> = sel
            .entries(row)
            .flat_map(|(_, a, b)| a.max(0)..b.min(limit as i64))
            .map(|j| j as usize)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    #[test]
    fn spans_match_the_keys_they_name() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: i32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % (2 * m as u64 + 1)) as i32 - m
        };
        let mut out = Vec::new();
        for case in 0..500 {
            let per_row = case % 5;
            let limit = (next(40) + 40) as usize;
            let sel = if case % 2 == 0 {
                let v = (0..per_row).map(|_| next(12)).collect();
                Spans::Blocks {
                    indices: v,
                    per_row,
                    block_size: 1 + case % 7,
                }
            } else {
                let v = (0..2 * per_row).map(|_| next(60)).collect();
                Spans::Ranges { ranges: v, per_row }
            };
            if per_row == 0 {
                assert_eq!(sel.rows(), 0);
                continue;
            }
            sel.row_spans(0, limit, &mut out);
            let flat: Vec<usize> = out.iter().flat_map(|&(a, b)| a..b).collect();
            assert_eq!(flat, keys(&sel, 0, limit), "case {case}: {sel:?}");
            assert!(
                out.windows(2).all(|w| w[0].1 < w[1].0),
                "not merged: {out:?}"
            );
        }
    }

    #[test]
    fn check_row_names_the_entry() {
        let sel = Spans::Ranges {
            ranges: vec![0, 4, 10, 12, 3, 5],
            per_row: 3,
        };
        let issue = sel.check_row(0, 20).unwrap_err();
        assert_eq!(issue.entry, 2);
        assert!(issue.msg.starts_with("overlaps"), "{issue:?}");
        let past = Spans::Blocks {
            indices: vec![-1, 3],
            per_row: 2,
            block_size: 8,
        };
        assert_eq!(past.check_row(0, 24).unwrap_err().entry, 1);
        assert!(past.check_row(0, 25).is_ok());
        let bad_pad = Spans::Blocks {
            indices: vec![0, -2],
            per_row: 2,
            block_size: 8,
        };
        assert_eq!(bad_pad.check_row(0, 24).unwrap_err().entry, 1);
    }
}
