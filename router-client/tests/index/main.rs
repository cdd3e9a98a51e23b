//! Tests of the prefix index: exact rules, random operation sequences against the reference,
//! lookups that follow stored runs, and lookups racing snapshot swaps.

mod concurrency;
mod crowd;
mod memo;
mod random;
mod rules;
mod runs;
mod util;
