//! Tests of the client side: admission over scripted streams (no network), and the follower
//! against a real relay server on `127.0.0.1:0`, with the example router's HTTP API.

mod admission;
mod daemon;
mod discovery;
mod fixtures;
mod fleet;
mod matching;
mod relay;
mod scripted;
mod storm;
mod util;
