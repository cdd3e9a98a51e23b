//! A value alone on its cache lines.

/// A value alone on its two cache lines (the adjacent-line prefetcher fetches lines in pairs):
/// for words writers change often, kept away from the words every lookup reads. A write to a
/// line a lookup reads costs that lookup a miss, and the first one of a lookup sits before
/// its grace section's swap, which waits for it.
#[repr(align(128))]
#[derive(Default)]
pub(super) struct Padded<T>(pub(super) T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}
