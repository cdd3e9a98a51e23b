//! The ordering rules of one rank's batches, without I/O: given a batch's seq and timestamp,
//! and what the replay socket answered, which batches are handed on, which are dropped as
//! duplicates, which are lost, and when the publisher restarted (the rank's health after a
//! control is [`crate::model::RankHealth::after`]). The rank's thread
//! (`rank.rs`) does what these say; the rules are those of its module docs.
//!
//! A rank's position is the last batch handed on: its seq and its engine timestamp. The
//! timestamp tells a batch of the same publisher from one of a restarted publisher with the
//! same seq (every release restarts its seqs at 0).

use super::rank::Resume;
use std::collections::VecDeque;
use std::ops::Range;

/// How many recent (seq, ts) pairs are remembered to tell duplicates from restarts. A replay
/// can refill at most the engine's buffer (10,000 batches by default).
pub(super) const RECENT: usize = 16_384;

/// What to do with a batch that came on the SUB socket.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Live {
    /// The batch after the last one: hand it on.
    Next,
    /// Already handed on (refilled from the replay socket): drop it.
    Duplicate,
    /// Batches are missing before it: refill `refill` from the replay socket, then hand it on.
    Gap { refill: Range<u64> },
    /// Its seq is not past the last one and it was never handed on: the publisher restarted
    /// (the last seq was `last`). Reset the rank, refill `refill` (its batches before this
    /// one), then hand it on.
    Restart { last: u64, refill: Range<u64> },
    /// Nothing is known of the rank: refill `refill` (the batches before this one), then hand
    /// it on.
    First { refill: Range<u64> },
}

/// One step of applying what a replay brought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fill {
    /// Hand on the replayed batch at this index of the answer.
    Apply(usize),
    /// These seqs are not in the answer: lost for good.
    Lost(Range<u64>),
}

/// What the replay socket's answer from a resumed rank's last seq says of its publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Primed {
    /// The answer starts with the batch the rank stopped at (same seq, same timestamp): the
    /// same publisher; what follows it is handed on.
    Resumed,
    /// The answer starts past it: the buffer rolled past where the rank stopped, and what came
    /// between is unknown (the same publisher or not); the whole answer is handed on
    /// ([`Sequencer::replayed`] says the hole lost).
    RolledPast,
    /// The batch is not there: another publisher. The rank is reset and read from seq 0.
    Changed,
}

/// One rank's position and the batches handed on lately.
#[derive(Debug, Default)]
pub(super) struct Sequencer {
    last: Option<(u64, f64)>,
    /// (seq, ts) of the batches handed on lately, newest last: a live batch with a seq not
    /// above the last one is a duplicate when it is here, and a publisher restart otherwise.
    recent: VecDeque<(u64, f64)>,
}

impl Sequencer {
    /// A rank resumed where the store left it, or a new one.
    pub fn new(resume: Option<Resume>) -> Sequencer {
        let last = resume.map(|r| (r.last_seq, r.last_ts));
        Sequencer { last, recent: last.into_iter().collect() }
    }

    /// The last batch handed on: (seq, engine timestamp).
    pub fn last(&self) -> Option<(u64, f64)> {
        self.last
    }

    /// Where a replay of what follows the last batch starts, with the check of its publisher.
    pub fn resume(&self) -> Option<Resume> {
        self.last.map(|(last_seq, last_ts)| Resume { last_seq, last_ts })
    }

    /// The rule for a live batch. `ts` decodes its timestamp, asked for only when its seq is
    /// not past the last one (`None` if it does not decode: then it is not a known batch).
    pub fn live(&self, seq: u64, ts: impl FnOnce() -> Option<f64>) -> Live {
        match self.last {
            Some((last, _)) if seq == last.wrapping_add(1) => Live::Next,
            Some((last, _)) if seq <= last => {
                let known =
                    ts().is_some_and(|ts| self.recent.iter().any(|(s, t)| *s == seq && t.to_bits() == ts.to_bits()));
                if known {
                    Live::Duplicate
                } else {
                    Live::Restart { last, refill: 0..seq }
                }
            }
            Some((last, _)) => Live::Gap { refill: last + 1..seq },
            None => Live::First { refill: 0..seq },
        }
    }

    /// The steps that hand on a replay's answer (`got`, its seqs in the order they came) for
    /// `from .. upto`, or for everything from `from` when `upto` is `None`: each batch in range
    /// that runs on from the one before is applied, each hole before one is lost, and so is the
    /// rest of a bounded range past the last. A seq the steps already passed is skipped.
    pub fn fill(from: u64, upto: Option<u64>, got: &[u64]) -> Vec<Fill> {
        let end = upto.unwrap_or(u64::MAX);
        let mut steps = Vec::new();
        let mut next = from;
        for (i, &seq) in got.iter().enumerate() {
            if seq < next || seq >= end {
                continue;
            }
            if seq != next {
                steps.push(Fill::Lost(next..seq));
            }
            steps.push(Fill::Apply(i));
            next = seq + 1;
        }
        if upto.is_some() && next < end {
            steps.push(Fill::Lost(next..end));
        }
        steps
    }

    /// The steps that hand on replayed batches after the last one (all of them when nothing is
    /// known), with a hole before any counted lost.
    pub fn replayed(&self, got: &[u64]) -> Vec<Fill> {
        let from = match self.last {
            Some((last, _)) => last + 1,
            None => got.first().copied().unwrap_or(0),
        };
        Self::fill(from, None, got)
    }

    /// What a replay from `resume`'s seq says of the publisher; `first` is the answer's first
    /// batch (seq, timestamp if it decodes).
    pub fn primed(resume: Resume, first: Option<(u64, Option<f64>)>) -> Primed {
        match first {
            Some((seq, Some(ts))) if seq == resume.last_seq && ts.to_bits() == resume.last_ts.to_bits() => {
                Primed::Resumed
            }
            Some((seq, _)) if seq > resume.last_seq => Primed::RolledPast,
            _ => Primed::Changed,
        }
    }

    /// True when a lost hole starting at `from` leaves the rank *incomplete* (nothing was known
    /// before it: old blocks may be missing, none is stale) rather than *degraded* (removals may
    /// be missing, so stale blocks may be held).
    pub fn lost_is_incomplete(&self, from: u64) -> bool {
        self.last.is_none() && from == 0
    }

    /// A batch handed on.
    pub fn handed_on(&mut self, seq: u64, ts: f64) {
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, ts));
        self.last = Some((seq, ts));
    }

    /// A batch that does not decode: its seq is consumed (the engine will never send it
    /// differently), the timestamp stays the last one known.
    pub fn consumed(&mut self, seq: u64) {
        self.last = Some((seq, self.last.map_or(0.0, |l| l.1)));
    }

    /// A publisher restart: nothing is known of the new one.
    pub fn reset(&mut self) {
        self.last = None;
        self.recent.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(seq: u64, ts: f64) -> Sequencer {
        let mut s = Sequencer::new(None);
        s.handed_on(seq, ts);
        s
    }

    #[test]
    fn a_live_batch_is_next_a_gap_a_duplicate_a_restart_or_the_first() {
        let s = at(7, 1.5);
        assert_eq!(s.live(8, || unreachable!("no timestamp is needed past the last seq")), Live::Next);
        assert_eq!(s.live(12, || None), Live::Gap { refill: 8..12 });
        // Not past the last seq: handed on lately with this timestamp, or a new publisher.
        assert_eq!(s.live(7, || Some(1.5)), Live::Duplicate);
        assert_eq!(s.live(7, || Some(9.0)), Live::Restart { last: 7, refill: 0..7 });
        assert_eq!(s.live(3, || None), Live::Restart { last: 7, refill: 0..3 });
        assert_eq!(s.live(0, || Some(0.0)), Live::Restart { last: 7, refill: 0..0 });
        let new = Sequencer::new(None);
        assert_eq!(new.live(0, || None), Live::First { refill: 0..0 });
        assert_eq!(new.live(5, || None), Live::First { refill: 0..5 });
        // A resumed rank is at the store's last batch, which counts as handed on.
        let resumed = Sequencer::new(Some(Resume { last_seq: 40, last_ts: 2.0 }));
        assert_eq!(resumed.live(40, || Some(2.0)), Live::Duplicate);
        assert_eq!(resumed.live(41, || None), Live::Next);
        // seq u64::MAX is followed by 0 only through a restart rule, never a wrap.
        assert_eq!(at(u64::MAX, 1.0).live(0, || Some(1.0)), Live::Next);
    }

    #[test]
    fn a_duplicate_is_known_only_while_it_is_among_the_recent_batches() {
        let mut s = Sequencer::new(None);
        for seq in 0..RECENT as u64 + 10 {
            s.handed_on(seq, seq as f64);
        }
        assert_eq!(s.live(10, || Some(10.0)), Live::Duplicate);
        assert_eq!(s.live(9, || Some(9.0)), Live::Restart { last: RECENT as u64 + 9, refill: 0..9 });
        s.reset();
        assert_eq!(s.last(), None);
        assert_eq!(s.live(10, || Some(10.0)), Live::First { refill: 0..10 });
    }

    #[test]
    fn a_replay_answer_fills_its_range_and_each_hole_is_lost() {
        use Fill::{Apply, Lost};
        assert_eq!(Sequencer::fill(5, Some(9), &[5, 6, 7, 8]), vec![Apply(0), Apply(1), Apply(2), Apply(3)]);
        // Rolled past 5..7, a hole at 8, the tail 10..12 missing.
        assert_eq!(
            Sequencer::fill(5, Some(12), &[7, 9]),
            vec![Lost(5..7), Apply(0), Lost(8..9), Apply(1), Lost(10..12)]
        );
        assert_eq!(Sequencer::fill(5, Some(8), &[]), vec![Lost(5..8)]);
        // Outside the range, or out of order: skipped.
        assert_eq!(Sequencer::fill(5, Some(8), &[3, 5, 5, 4, 6, 9, 7]), vec![Apply(1), Apply(4), Apply(6)]);
        // Unbounded: no tail is lost.
        assert_eq!(Sequencer::fill(5, None, &[5, 8]), vec![Apply(0), Lost(6..8), Apply(1)]);
        // After the last batch; from the first one when nothing is known.
        assert_eq!(at(4, 0.0).replayed(&[3, 4, 5, 7]), vec![Apply(2), Lost(6..7), Apply(3)]);
        assert_eq!(Sequencer::new(None).replayed(&[3, 4]), vec![Apply(0), Apply(1)]);
        assert_eq!(Sequencer::new(None).replayed(&[]), vec![]);
    }

    #[test]
    fn priming_tells_the_same_publisher_a_rolled_buffer_and_a_new_publisher() {
        let r = Resume { last_seq: 10, last_ts: 3.25 };
        assert_eq!(Sequencer::primed(r, Some((10, Some(3.25)))), Primed::Resumed);
        assert_eq!(Sequencer::primed(r, Some((10, Some(3.5)))), Primed::Changed);
        assert_eq!(Sequencer::primed(r, Some((10, None))), Primed::Changed);
        assert_eq!(Sequencer::primed(r, Some((14, None))), Primed::RolledPast);
        assert_eq!(Sequencer::primed(r, Some((11, Some(0.0)))), Primed::RolledPast);
        assert_eq!(Sequencer::primed(r, Some((2, Some(3.25)))), Primed::Changed);
        assert_eq!(Sequencer::primed(r, None), Primed::Changed);
    }

    #[test]
    fn a_hole_is_incomplete_only_at_the_start_of_an_unknown_rank() {
        assert!(Sequencer::new(None).lost_is_incomplete(0));
        assert!(!Sequencer::new(None).lost_is_incomplete(3));
        assert!(!at(0, 0.0).lost_is_incomplete(0));
        let mut s = at(5, 1.0);
        s.consumed(6);
        assert_eq!(s.last(), Some((6, 1.0)));
        assert_eq!(Sequencer::new(None).resume(), None);
        assert_eq!(s.resume(), Some(Resume { last_seq: 6, last_ts: 1.0 }));
    }

    /// One step of the model: the engine publishes or restarts; the rank reads its SUB socket,
    /// or, quiet, probes the replay socket for a lost tail.
    #[derive(Debug, Clone)]
    enum Step {
        /// The engine publishes a batch and buffers it for replay; `delivered` says whether the
        /// SUB socket gets it (in order: a PUB socket never reorders).
        Publish { delivered: bool },
        /// The engine restarts: a new publisher from seq 0, with an empty buffer.
        Restart,
        /// The rank reads the next message its SUB socket holds.
        Receive,
        /// The rank is quiet: what the SUB socket holds is read first (the live socket's first
        /// claim), then the replay socket is asked for what follows the last batch.
        Probe,
        /// A probe whose answer comes before what the SUB socket holds (it arrived after the
        /// live socket's first claim ended): the SUB's batches come after the replay's.
        ProbeRacing,
    }

    /// A batch's timestamp: unique to its publisher and seq.
    fn ts(publisher: u32, seq: u64) -> f64 {
        f64::from(publisher) * 1e6 + seq as f64
    }

    /// What the rank did, as the relay's readers see it: batches handed on, holes said lost,
    /// and resets (which start a new run of seqs).
    #[derive(Debug, Clone, PartialEq)]
    enum Out {
        Handed(u32, u64),
        Lost(Range<u64>),
        Reset,
    }

    /// The engine and the rank's use of the sequencer, as `rank.rs` composes it.
    struct Model {
        publisher: u32,
        next_seq: u64,
        /// The current publisher's replay buffer: its newest `buffer` seqs.
        replay: VecDeque<u64>,
        buffer: usize,
        /// The SUB socket's queue: (publisher, seq).
        sub: VecDeque<(u32, u64)>,
        seq: Sequencer,
        out: Vec<Out>,
    }

    impl Model {
        fn replay_from(&self, from: u64) -> Vec<u64> {
            self.replay.iter().copied().filter(|&q| q >= from).collect()
        }

        fn fill(&mut self, fills: Vec<Fill>, got: &[u64]) -> Result<(), TestCaseError> {
            for f in fills {
                match f {
                    Fill::Apply(i) => self.hand_on(got[i]),
                    Fill::Lost(r) => {
                        // Lost only what the buffer does not hold.
                        prop_assert!(
                            r.clone().all(|q| !self.replay.contains(&q)),
                            "lost {:?} from {:?}",
                            r,
                            self.replay
                        );
                        self.out.push(Out::Lost(r));
                    }
                }
            }
            Ok(())
        }

        fn hand_on(&mut self, seq: u64) {
            self.out.push(Out::Handed(self.publisher, seq));
            self.seq.handed_on(seq, ts(self.publisher, seq));
        }

        fn reset(&mut self) {
            self.seq.reset();
            self.out.push(Out::Reset);
        }

        fn receive(&mut self) -> Result<(), TestCaseError> {
            let Some((p, seq)) = self.sub.pop_front() else { return Ok(()) };
            prop_assert_eq!(p, self.publisher, "the SUB socket is read out before a restart");
            let refill = match self.seq.live(seq, || Some(ts(p, seq))) {
                Live::Next => None,
                Live::Duplicate => return Ok(()),
                Live::Restart { refill, .. } => {
                    self.reset();
                    Some(refill)
                }
                Live::Gap { refill } | Live::First { refill } => Some(refill),
            };
            if let Some(r) = refill.filter(|r| !r.is_empty()) {
                let got = self.replay_from(r.start);
                self.fill(Sequencer::fill(r.start, Some(r.end), &got), &got)?;
            }
            self.hand_on(seq);
            Ok(())
        }

        fn probe(&mut self, live_first: bool) -> Result<(), TestCaseError> {
            while live_first && !self.sub.is_empty() {
                self.receive()?;
            }
            let resume = self.seq.resume();
            let got = self.replay_from(resume.map_or(0, |r| r.last_seq));
            let from_zero = match resume {
                None => got,
                Some(r) => {
                    let first = got.first().map(|&q| (q, Some(ts(self.publisher, q))));
                    match Sequencer::primed(r, first) {
                        Primed::Resumed => {
                            let rest = &got[1..];
                            return self.fill(self.seq.replayed(rest), rest);
                        }
                        Primed::RolledPast => return self.fill(self.seq.replayed(&got), &got),
                        Primed::Changed => {
                            self.reset();
                            self.replay_from(0)
                        }
                    }
                }
            };
            if let Some(&first) = from_zero.first().filter(|&&f| f > 0) {
                self.out.push(Out::Lost(0..first));
            }
            self.fill(self.seq.replayed(&from_zero), &from_zero)
        }

        fn step(&mut self, step: &Step) -> Result<(), TestCaseError> {
            match *step {
                Step::Publish { delivered } => {
                    let seq = self.next_seq;
                    self.next_seq += 1;
                    self.replay.push_back(seq);
                    if self.replay.len() > self.buffer {
                        self.replay.pop_front();
                    }
                    if delivered {
                        self.sub.push_back((self.publisher, seq));
                    }
                }
                Step::Restart => {
                    // The old connection's messages are read before the new one's.
                    while !self.sub.is_empty() {
                        self.receive()?;
                    }
                    self.publisher += 1;
                    self.next_seq = 0;
                    self.replay.clear();
                }
                Step::Receive => self.receive()?,
                Step::Probe => self.probe(true)?,
                Step::ProbeRacing => self.probe(false)?,
            }
            Ok(())
        }
    }

    /// Runs the model and checks what the rank did: between resets, the seqs handed on run on
    /// from 0 one by one, each skipped seq in exactly one hole said lost, and no batch is handed
    /// on twice (a racing probe makes duplicates); a reset follows a restart of the engine or a
    /// hole; and after a final probe the rank holds the newest batch the engine buffered.
    fn run(steps: &[Step], buffer: usize) -> Result<(), TestCaseError> {
        let mut m = Model {
            publisher: 0,
            next_seq: 0,
            replay: VecDeque::new(),
            buffer,
            sub: VecDeque::new(),
            seq: Sequencer::new(None),
            out: Vec::new(),
        };
        // Whether the engine restarted since the rank's last reset.
        let mut restarted = false;
        let mut restarts = Vec::new();
        for step in steps.iter().chain([Step::Probe].iter()) {
            let resets = m.out.iter().filter(|o| **o == Out::Reset).count();
            m.step(step)?;
            if m.out.iter().filter(|o| **o == Out::Reset).count() > resets {
                restarts.push(restarted);
                restarted = false;
            }
            restarted |= matches!(step, Step::Restart);
        }
        let mut expect = 0u64;
        let mut seen = std::collections::HashSet::new();
        let mut lost = false;
        let mut resets = restarts.into_iter();
        for o in &m.out {
            match o {
                Out::Reset => {
                    // A reset without a restart only where a racing probe lost a hole: the
                    // SUB's late batches then look like another publisher's.
                    let restarted = resets.next().expect("one flag per reset");
                    prop_assert!(restarted || lost, "a reset with no restart and nothing lost: {:?}", m.out);
                    expect = 0;
                    seen.clear();
                    lost = false;
                }
                Out::Lost(r) => {
                    prop_assert!(
                        r.start == expect && r.end > r.start,
                        "hole {:?} where {} is next: {:?}",
                        r,
                        expect,
                        m.out
                    );
                    expect = r.end;
                    lost = true;
                }
                Out::Handed(p, seq) => {
                    prop_assert_eq!(*seq, expect, "out of order: {:?}", m.out);
                    prop_assert!(seen.insert((*p, *seq)), "({}, {}) handed on twice: {:?}", p, seq, m.out);
                    expect += 1;
                }
            }
        }
        if let Some(&newest) = m.replay.back() {
            prop_assert_eq!(m.seq.last(), Some((newest, ts(m.publisher, newest))), "{:?}", m.out);
        }
        Ok(())
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            prop_oneof![
                6 => Just(Step::Publish { delivered: true }),
                2 => Just(Step::Publish { delivered: false }),
                5 => Just(Step::Receive),
                1 => Just(Step::Probe),
                1 => Just(Step::ProbeRacing),
                1 => Just(Step::Restart),
            ],
            0..300,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn every_batch_is_handed_on_once_in_order_or_said_lost(steps in steps(), buffer in 1usize..16) {
            run(&steps, buffer)?;
        }

        #[test]
        fn with_a_buffer_that_holds_everything_and_no_restart_each_batch_is_handed_on_once(steps in steps()) {
            let steps: Vec<Step> = steps.into_iter().filter(|s| !matches!(s, Step::Restart)).collect();
            let mut m = Model {
                publisher: 0,
                next_seq: 0,
                replay: VecDeque::new(),
                buffer: usize::MAX,
                sub: VecDeque::new(),
                seq: Sequencer::new(None),
                out: Vec::new(),
            };
            for step in steps.iter().chain([Step::Probe].iter()) {
                m.step(step)?;
            }
            let handed: Vec<Out> = (0..m.next_seq).map(|q| Out::Handed(0, q)).collect();
            prop_assert_eq!(m.out, handed);
        }
    }
}
