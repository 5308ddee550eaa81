//! An incrementally maintained suffix index over several token streams: a generalized suffix automaton with its
//! suffix-link tree and the end positions of every occurrence.
//!
//! The automaton is built online (Blumer et al.; the generalized form keeps one "last" state per stream, so
//! streams can grow interleaved, as the siblings of a GRPO group commit their tokens round by round). Appending a
//! token costs amortised O(1) state and transition updates (transitions are sorted vectors, so a lookup is
//! O(log d) in the out-degree d); the suffix-link tree is maintained alongside with O(1) work per new or cloned
//! state, and every position is recorded at the state that owns it, so the end positions of any substring are
//! the positions owned in its state's link subtree.

use crate::{Error, Result};

/// Index of a state in a [`SuffixIndex`].
pub type StateId = u32;

const NONE: u32 = u32::MAX;
/// The root state (the empty string).
const ROOT: StateId = 0;

/// An occurrence: the end position `end` (index of the last token of the match) in stream `stream`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Occurrence {
    /// The stream.
    pub stream: usize,
    /// Index, in that stream, of the match's last token.
    pub end: usize,
}

#[derive(Debug, Clone)]
struct State {
    /// Length of the longest string of this state.
    len: u32,
    /// Suffix link (`NONE` for the root).
    link: u32,
    /// This state's index in its link parent's `children`.
    slot: u32,
    /// Head of this state's list of owned positions in `positions` (`NONE`: none).
    own: u32,
    /// Transitions, sorted by token.
    next: Vec<(u32, u32)>,
    /// Children in the suffix-link tree.
    children: Vec<u32>,
}

impl State {
    fn new(len: u32, link: u32) -> Self {
        Self { len, link, slot: 0, own: NONE, next: Vec::new(), children: Vec::new() }
    }

    fn get(&self, token: u32) -> Option<u32> {
        self.next.binary_search_by_key(&token, |e| e.0).ok().map(|i| self.next[i].1)
    }

    fn set(&mut self, token: u32, to: u32) {
        match self.next.binary_search_by_key(&token, |e| e.0) {
            Ok(i) => self.next[i].1 = to,
            Err(i) => self.next.insert(i, (token, to)),
        }
    }
}

/// A position owned by a state: `(stream, end)` plus the next entry of the owner's list.
#[derive(Debug, Clone, Copy)]
struct Owned {
    stream: u32,
    end: u32,
    next: u32,
}

#[derive(Debug, Clone)]
struct Stream {
    tokens: Vec<u32>,
    /// The state whose longest string is the whole stream.
    last: u32,
}

/// A suffix automaton over a set of token streams that grow by appending.
///
/// ```
/// use tlt_spec_decode::SuffixIndex;
///
/// # fn main() -> tlt_spec_decode::Result<()> {
/// let mut ix = SuffixIndex::new();
/// let a = ix.add_stream(&[1, 2, 3, 4]);
/// let b = ix.add_stream(&[9, 2, 3]);
/// // The longest suffix of stream b followed by something anywhere: "2 3" (followed by 4 in stream a).
/// let (state, len) = ix.continuation_state(b)?;
/// assert_eq!(len, 2);
/// assert_eq!(ix.next_tokens(state), vec![4]);
/// ix.append(b, 5)?;
/// assert_eq!(ix.stream(b)?, &[9, 2, 3, 5]);
/// assert_eq!(ix.stream(a)?.len(), 4);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct SuffixIndex {
    states: Vec<State>,
    positions: Vec<Owned>,
    streams: Vec<Stream>,
    tokens: usize,
    work: u64,
}

impl Default for SuffixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl SuffixIndex {
    /// An empty index (no stream).
    pub fn new() -> Self {
        Self { states: vec![State::new(0, NONE)], positions: Vec::new(), streams: Vec::new(), tokens: 0, work: 0 }
    }

    /// Number of streams.
    pub fn num_streams(&self) -> usize {
        self.streams.len()
    }

    /// Tokens in all streams together.
    pub fn num_tokens(&self) -> usize {
        self.tokens
    }

    /// Number of automaton states (at most `2 × num_tokens + 1`).
    pub fn num_states(&self) -> usize {
        self.states.len()
    }

    /// Elementary update steps so far: transitions added, redirected or copied into clones, and states
    /// created. The online construction keeps this below a small constant times [`SuffixIndex::num_tokens`]
    /// (amortised O(1) per appended token), whatever the text.
    pub fn update_steps(&self) -> u64 {
        self.work
    }

    /// The tokens of stream `s`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown stream.
    pub fn stream(&self, s: usize) -> Result<&[u32]> {
        Ok(&self.get_stream(s)?.tokens)
    }

    fn get_stream(&self, s: usize) -> Result<&Stream> {
        self.streams.get(s).ok_or_else(|| Error::InvalidArgument(format!("unknown suffix-index stream {s}")))
    }

    /// Adds a stream holding `tokens` and returns its id (ids count from 0).
    pub fn add_stream(&mut self, tokens: &[u32]) -> usize {
        let id = self.streams.len();
        self.streams.push(Stream { tokens: Vec::with_capacity(tokens.len()), last: ROOT });
        for &t in tokens {
            self.push(id, t);
        }
        id
    }

    /// Appends `token` to stream `s`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown stream or a stream at `u32::MAX` tokens.
    pub fn append(&mut self, s: usize, token: u32) -> Result<()> {
        let len = self.get_stream(s)?.tokens.len();
        if len >= (NONE - 1) as usize || self.states.len() >= (NONE - 2) as usize {
            return Err(Error::InvalidArgument("suffix index is full".into()));
        }
        self.push(s, token);
        Ok(())
    }

    /// Appends every token of `tokens` to stream `s`.
    ///
    /// # Errors
    /// As [`SuffixIndex::append`].
    pub fn extend(&mut self, s: usize, tokens: &[u32]) -> Result<()> {
        for &t in tokens {
            self.append(s, t)?;
        }
        Ok(())
    }

    /// Makes `child` the last child of `parent` in the link tree.
    fn adopt(&mut self, parent: u32, child: u32) {
        let p = &mut self.states[parent as usize];
        let slot = p.children.len() as u32;
        p.children.push(child);
        self.states[child as usize].slot = slot;
    }

    fn own(&mut self, state: u32, stream: usize, end: usize) {
        let head = self.states[state as usize].own;
        self.positions.push(Owned { stream: stream as u32, end: end as u32, next: head });
        self.states[state as usize].own = (self.positions.len() - 1) as u32;
    }

    /// Splits `q` (reached from `p` by `c`) so that a state of length `len(p) + 1` exists; returns the clone.
    fn clone_state(&mut self, p: u32, c: u32, q: u32) -> u32 {
        let (qlink, qslot) = (self.states[q as usize].link, self.states[q as usize].slot);
        let plen = self.states[p as usize].len;
        let clone = self.states.len() as u32;
        let mut st = State::new(plen + 1, qlink);
        st.next = self.states[q as usize].next.clone();
        self.work += 1 + st.next.len() as u64;
        st.slot = qslot;
        self.states.push(st);
        // The clone takes q's place under q's old parent; q moves below the clone.
        self.states[qlink as usize].children[qslot as usize] = clone;
        self.states[q as usize].link = clone;
        self.adopt(clone, q);
        let mut p = p;
        while p != NONE && self.states[p as usize].get(c) == Some(q) {
            self.work += 1;
            self.states[p as usize].set(c, clone);
            p = self.states[p as usize].link;
        }
        clone
    }

    /// The generalized online extension of stream `s` by `c`.
    fn push(&mut self, s: usize, c: u32) {
        let last = self.streams[s].last;
        let end = self.streams[s].tokens.len();
        self.streams[s].tokens.push(c);
        self.tokens += 1;
        // The whole new stream already exists as a string: no new state, unless a split is needed.
        if let Some(q) = self.states[last as usize].get(c) {
            let cur = if self.states[q as usize].len == self.states[last as usize].len + 1 {
                q
            } else {
                self.clone_state(last, c, q)
            };
            self.own(cur, s, end);
            self.streams[s].last = cur;
            return;
        }
        let cur_len = self.states[last as usize].len + 1;
        let cur = self.states.len() as u32;
        self.states.push(State::new(cur_len, NONE));
        let mut p = last;
        self.work += 1;
        while p != NONE && self.states[p as usize].get(c).is_none() {
            self.work += 1;
            self.states[p as usize].set(c, cur);
            p = self.states[p as usize].link;
        }
        let link = if p == NONE {
            ROOT
        } else {
            let q = self.states[p as usize].get(c).unwrap_or(ROOT);
            if self.states[p as usize].len + 1 == self.states[q as usize].len {
                q
            } else {
                self.clone_state(p, c, q)
            }
        };
        self.states[cur as usize].link = link;
        self.adopt(link, cur);
        self.own(cur, s, end);
        self.streams[s].last = cur;
    }

    /// The state of `pattern` (walking transitions from the root), if it occurs.
    pub fn find(&self, pattern: &[u32]) -> Option<StateId> {
        let mut v = ROOT;
        for &t in pattern {
            v = self.states[v as usize].get(t)?;
        }
        Some(v)
    }

    /// Length of the longest string of `state`.
    pub fn state_len(&self, state: StateId) -> usize {
        self.states.get(state as usize).map_or(0, |s| s.len as usize)
    }

    /// The tokens that follow some occurrence of `state`'s strings, ascending.
    pub fn next_tokens(&self, state: StateId) -> Vec<u32> {
        self.states.get(state as usize).map_or_else(Vec::new, |s| s.next.iter().map(|e| e.0).collect())
    }

    /// The longest suffix of stream `s` that occurs somewhere (in any stream) followed by a token: its state and
    /// its length. `(0, 0)` (the root, the empty string) when even the empty suffix has no continuation (an empty index).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown stream.
    pub fn continuation_state(&self, s: usize) -> Result<(StateId, usize)> {
        let mut v = self.get_stream(s)?.last;
        while v != ROOT && self.states[v as usize].next.is_empty() {
            v = self.states[v as usize].link;
        }
        Ok((v, self.states[v as usize].len as usize))
    }

    /// End positions of `state`'s strings that are followed by at least one token, newer states first, at most
    /// `cap` of them (`usize::MAX`: all).
    pub fn occurrences(&self, state: StateId, cap: usize) -> Vec<Occurrence> {
        let mut out = Vec::new();
        if state as usize >= self.states.len() || cap == 0 {
            return out;
        }
        let mut stack = vec![state];
        while let Some(v) = stack.pop() {
            let st = &self.states[v as usize];
            let mut o = st.own;
            while o != NONE {
                let p = self.positions[o as usize];
                let (stream, end) = (p.stream as usize, p.end as usize);
                if end + 1 < self.streams[stream].tokens.len() {
                    out.push(Occurrence { stream, end });
                    if out.len() >= cap {
                        return out;
                    }
                }
                o = p.next;
            }
            // Pushed in creation order, so the newest child is popped first.
            stack.extend_from_slice(&st.children);
        }
        out
    }

    /// Up to `len` tokens following occurrence `o`.
    pub fn continuation(&self, o: Occurrence, len: usize) -> &[u32] {
        self.streams.get(o.stream).map_or(&[], |s| {
            let from = (o.end + 1).min(s.tokens.len());
            &s.tokens[from..(from + len).min(s.tokens.len())]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_stream_counts() {
        let mut ix = SuffixIndex::new();
        let s = ix.add_stream(&[1, 2, 1, 2, 1]);
        let st = ix.find(&[1, 2]).expect("occurs");
        let mut occ = ix.occurrences(st, usize::MAX);
        occ.sort();
        assert_eq!(occ, vec![Occurrence { stream: s, end: 1 }, Occurrence { stream: s, end: 3 }]);
        assert_eq!(ix.find(&[2, 2]), None);
        let (st, len) = ix.continuation_state(s).expect("stream");
        assert_eq!(len, 3); // "1 2 1" occurs at 0..3, followed by 2
        assert_eq!(ix.next_tokens(st), vec![2]);
        assert!(ix.num_states() <= 2 * ix.num_tokens() + 1);
    }

    #[test]
    fn unknown_stream_is_an_error() {
        let mut ix = SuffixIndex::new();
        assert!(ix.append(0, 1).is_err());
        assert!(ix.continuation_state(3).is_err());
        assert!(ix.stream(0).is_err());
        assert!(ix.occurrences(99, 5).is_empty());
        let empty = ix.add_stream(&[]);
        assert_eq!(ix.continuation_state(empty).expect("stream"), (ROOT, 0));
    }
}
