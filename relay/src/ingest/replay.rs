//! The replay client: a rank's requests to its engine's replay ROUTER, and how an answer fell
//! short (a timeout, a dropped connection, a cut batch), so that each hole is lost for its cause.

use super::rank::RankConfig;
use super::watched::Watched;
use crate::wire::{self, ReplayReply};
use std::time::Duration;

#[derive(Debug)]
pub(super) enum ReplayError {
    NoEndpoint,
    /// Nothing came for this long.
    Timeout(Duration),
    /// The connection dropped while sending a batch this many times in one replay.
    Cut(u32),
    Zmq(zmq::Error),
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::NoEndpoint => f.write_str("no replay endpoint configured"),
            ReplayError::Timeout(t) => {
                write!(f, "the replay socket did not answer within replay_timeout_ms, {}", t.as_millis())
            }
            ReplayError::Cut(n) => write!(f, "the replay connection dropped while sending a batch, {n} times"),
            ReplayError::Zmq(e) => write!(f, "replay socket: {e}"),
        }
    }
}

/// Batches read from the replay socket, (seq, payload), in order.
pub(super) type Replayed = Vec<(u64, Vec<u8>)>;

/// How a replay request's answer ended.
enum Reply {
    /// The end marker: every buffered batch from the seq asked for was sent.
    End,
    /// The connection dropped before the end marker (see [`ReplayClient::fetch`]).
    Cut,
}

/// How many times one replay asks again past a batch that dropped its connection.
pub(super) const MAX_CUTS: u32 = 16;

/// How a replay fell short of the whole answer, and where, so that each hole it left is said to
/// be lost for its own cause. A hole can also have none of them: the engine's buffer no longer
/// held those batches (it rolled past them, or had never held them).
#[derive(Debug, Default)]
pub(super) struct Shortfall {
    /// The seqs whose batch dropped the connection (a message over `max_message_bytes`): each
    /// was asked past.
    cuts: Vec<u64>,
    /// Why the replay ended before the end marker (it timed out, its socket failed, or it was
    /// cut [`MAX_CUTS`] times), and the seq it stopped at: the first it did not bring.
    failed: Option<(u64, String)>,
}

impl Shortfall {
    /// Why `from .. upto` is lost, when this replay's shortfall is why: a hole holding a cut
    /// batch lost it to the cut, and a hole reaching past where the replay stopped lost those
    /// batches to the failure. `None` for a hole the answer had closed on both sides.
    pub fn why(&self, from: u64, upto: u64, max_message_bytes: u64) -> Option<String> {
        let mut why = Vec::new();
        if self.cuts.iter().any(|&c| from <= c && c < upto) {
            why.push(format!(
                "the connection dropped while the engine sent them (a message over max_message_bytes, \
                 {max_message_bytes} bytes, drops it)"
            ));
        }
        if let Some((_, e)) = self.failed.as_ref().filter(|(stop, _)| upto > *stop) {
            why.push(format!("the replay ended before the engine sent them all ({e})"));
        }
        (!why.is_empty()).then(|| why.join("; "))
    }
}

/// What a replay meets on its way, for its rank to count and log.
pub(super) enum Heard {
    /// The connection dropped while the engine sent the batch with this seq: asked past it.
    Cut(u64),
    /// A reply that is not a replay message (its error's name).
    Bad(&'static str),
}

/// A rank's client of its engine's replay ROUTER: one DEALER, opened when first needed and
/// replaced after a drop or a timeout, and how the last replay fell short.
pub(super) struct ReplayClient {
    endpoint: Option<String>,
    max_message_bytes: u64,
    timeout: Duration,
    dealer: Option<Watched>,
    /// How the last replay fell short, and where: a hole it left is said to be lost that way.
    short: Shortfall,
}

impl ReplayClient {
    pub fn new(cfg: &RankConfig) -> ReplayClient {
        ReplayClient {
            endpoint: cfg.replay_endpoint.clone(),
            max_message_bytes: cfg.max_message_bytes,
            timeout: cfg.replay_timeout,
            dealer: None,
            short: Shortfall::default(),
        }
    }

    /// How the last replay fell short.
    pub fn shortfall(&self) -> &Shortfall {
        &self.short
    }

    /// Asks the replay socket for every buffered batch from `from`, in order, into `out`; on an
    /// error `out` keeps what arrived before it.
    ///
    /// A batch larger than `max_message_bytes` drops the DEALER's connection (libzmq reads no
    /// further), and the engine's ROUTER drops the rest of its answer. The replay keeps the
    /// batches before it and asks again from the seq after it, at most [`MAX_CUTS`] times: the
    /// batch it could not take is a hole, which the caller's gap rule counts as lost, and the
    /// batches after it are still refilled.
    pub fn fetch(
        &mut self,
        ctx: &zmq::Context,
        from: u64,
        out: &mut Replayed,
        mut heard: impl FnMut(Heard),
    ) -> Result<(), ReplayError> {
        self.short = Shortfall::default();
        let mut ask = from;
        let mut cuts = 0;
        loop {
            let before = out.len();
            let reply = self.once(ctx, ask, out, &mut heard);
            // Where this answer stopped: past the last batch it brought, else where it was asked.
            let stop = if out.len() > before { out[out.len() - 1].0 + 1 } else { ask };
            match reply {
                Err(e) => {
                    self.short.failed = Some((stop, e.to_string()));
                    return Err(e);
                }
                Ok(Reply::End) => return Ok(()),
                Ok(Reply::Cut) => {
                    // The batch after the last one received did not arrive.
                    let cut_at = stop;
                    cuts += 1;
                    self.short.cuts.push(cut_at);
                    heard(Heard::Cut(cut_at));
                    if cuts == MAX_CUTS {
                        let e = ReplayError::Cut(cuts);
                        self.short.failed = Some((cut_at + 1, e.to_string()));
                        return Err(e);
                    }
                    ask = cut_at + 1;
                }
            }
        }
    }

    /// One replay request from `ask`: its batches are appended to `out`.
    fn once(
        &mut self,
        ctx: &zmq::Context,
        ask: u64,
        out: &mut Replayed,
        heard: &mut impl FnMut(Heard),
    ) -> Result<Reply, ReplayError> {
        let Some(endpoint) = self.endpoint.as_deref() else {
            return Err(ReplayError::NoEndpoint);
        };
        if self.dealer.is_none() {
            let d = Watched::open(ctx, zmq::DEALER, endpoint, self.max_message_bytes, |d| d.set_rcvhwm(0))
                .map_err(ReplayError::Zmq)?;
            self.dealer = Some(d);
        }
        let d = self.dealer.as_ref().expect("dealer");
        d.forget_drops();
        d.socket.send_multipart([&b""[..], &ask.to_be_bytes()[..]], 0).map_err(ReplayError::Zmq)?;
        let mut take = |frames: Vec<Vec<u8>>, out: &mut Replayed| {
            let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
            match wire::split_replay(&refs) {
                Ok(ReplayReply::End) => true,
                Ok(ReplayReply::Batch(f)) => {
                    out.push((f.seq, f.payload.to_vec()));
                    false
                }
                Err(e) => {
                    heard(Heard::Bad(e.as_str()));
                    false
                }
            }
        };
        loop {
            let mut items = [d.socket.as_poll_item(zmq::POLLIN), d.monitor.as_poll_item(zmq::POLLIN)];
            zmq::poll(&mut items, self.timeout.as_millis() as i64).map_err(ReplayError::Zmq)?;
            if items[0].is_readable() {
                // Replies first: what arrived before a drop is kept.
                if take(d.socket.recv_multipart(0).map_err(ReplayError::Zmq)?, out) {
                    return Ok(Reply::End);
                }
                continue;
            }
            if items[1].is_readable() {
                // Dropped: the replies read before the drop first.
                let end = d.settle(|frames| take(frames, out)).map_err(ReplayError::Zmq)?;
                self.dealer = None;
                return Ok(if end { Reply::End } else { Reply::Cut });
            }
            // Drop the socket so a late answer cannot be mistaken for the next one's.
            self.dealer = None;
            return Err(ReplayError::Timeout(self.timeout));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_hole_a_short_replay_left_is_said_to_be_lost_for_its_own_cause() {
        const CUT: &str = "the connection dropped while the engine sent them (a message over max_message_bytes, \
                           1024 bytes, drops it)";
        let failed = "the replay ended before the engine sent them all (the replay socket did not answer within \
                      replay_timeout_ms, 300)";
        // Asked from 10; the answer began at 20 (the buffer had rolled past 10..19), batch 25 was
        // cut, the answer asked past it brought 26..29 and then timed out.
        let s = Shortfall {
            cuts: vec![25],
            failed: Some((30, ReplayError::Timeout(Duration::from_millis(300)).to_string())),
        };
        let why = |from, upto| s.why(from, upto, 1024);
        assert_eq!(why(10, 20), None);
        assert_eq!(why(25, 26).as_deref(), Some(CUT));
        assert_eq!(why(24, 27).as_deref(), Some(CUT));
        assert_eq!(why(26, 30), None);
        assert_eq!(why(30, 31).as_deref(), Some(failed));
        assert_eq!(why(29, 40).as_deref(), Some(failed));
        // One hole holding the cut and reaching past the stop names both.
        assert_eq!(why(25, 31), Some(format!("{CUT}; {failed}")));
        assert_eq!(Shortfall::default().why(0, u64::MAX, 1024), None);
        // Cut as often as it asks again: the batches past the last cut were not asked for.
        let e = ReplayError::Cut(MAX_CUTS).to_string();
        assert_eq!(e, "the replay connection dropped while sending a batch, 16 times");
        let s = Shortfall { cuts: (40..40 + u64::from(MAX_CUTS)).collect(), failed: Some((56, e)) };
        assert_eq!(s.why(55, 56, 1024).as_deref(), Some(CUT));
        assert_eq!(
            s.why(56, 60, 1024).as_deref(),
            Some(
                "the replay ended before the engine sent them all (the replay connection dropped while sending \
                 a batch, 16 times)"
            )
        );
    }
}
