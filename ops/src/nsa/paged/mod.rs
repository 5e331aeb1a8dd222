//! The NSA layer's decode state on pages a server owns: raw keys / values and compressed keys /
//! values live in page pools ([`NsaPages`]) that every sequence shares, a sequence's state
//! ([`NsaSeqState`]) is two page lists and two lengths, and the server's allocator
//! ([`PageAllocator`], reached through a [`SharedAllocator`]) hands pages out and takes them
//! back. A state owns its pages: dropping it returns them. Forking a state shares every page
//! (prefix sharing); a page another state still holds is copied on the first write that would
//! change it, so the copies never see each other's tokens. Rolling back is a truncation that
//! releases the pages past the new end. [`NsaCache`] is the convenience over these for a
//! caller that does not manage pages: a state per batch row on pools it owns and grows.
//!
//! Bottom up: `alloc` (pools' bookkeeping), `pages` (the pools' tensors), `state` (one
//! sequence), `step` (the layer's step on a state), `cache` (the layer's own states).

mod alloc;
mod cache;
mod pages;
mod state;
mod step;

pub use alloc::{NsaPool, PageAllocator, PagePool, SharedAllocator};
pub use cache::NsaCache;
pub use pages::NsaPages;
pub use state::NsaSeqState;
