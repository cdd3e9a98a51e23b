//! Tests of the prefix index: exact rules, random operation sequences against the reference,
//! and lookups racing snapshot swaps.

mod concurrency;
mod random;
mod rules;
mod util;
