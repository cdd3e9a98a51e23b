use super::super::packed::holder;
use super::*;

#[test]
fn match_byte_flags_equal_bytes_and_never_empty_ones() {
    let word = u64::from_le_bytes([0x80, 0x12, 0x13, 0x80, 0x12, 0x7f, 0x00, 0x80]);
    let m = match_byte(word, 0x12);
    assert_ne!(m & (0x80 << 8), 0);
    assert_ne!(m & (0x80 << 32), 0);
    for empty_byte in [0, 3, 7] {
        assert_eq!(m & (0x80 << (8 * empty_byte)), 0);
    }
    // The overflow byte never matches, whatever its value.
    let word = u64::from_le_bytes([0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x12]);
    assert_eq!(match_byte(word, 0x12), 0);
    assert!(overflowed(word));
}

#[test]
fn probes_stop_at_home_when_no_insert_overflowed_it() {
    let t = Table::for_entries(1000);
    let o = Overflow::default();
    for k in 0..900u64 {
        assert!(matches!(t.add(&Probe::new(k), holder(0, 0, 0), 1, &mut || 7, &o, 0), Added::Done { .. }));
    }
    // Some groups filled up and overflowed; every key is still found, exactly once.
    let overflowing = t.ctrl.iter().filter(|w| overflowed(w.load(Ordering::Relaxed))).count();
    assert!(overflowing > 0, "the test should exercise overflow");
    for k in 0..900u64 {
        let mut n = 0;
        t.for_each(&Probe::new(k), |_| n += 1);
        assert_eq!(n, 1, "key {k}");
    }
    let r = t.rebuilt(0);
    for k in 0..900u64 {
        let mut n = 0;
        r.for_each(&Probe::new(k), |_| n += 1);
        assert_eq!(n, 1, "key {k} after rebuild");
    }
}

#[test]
fn table_grows_only_through_full_and_keeps_values_on_rebuild() {
    let t = Table::for_entries(0);
    let h = holder(1, 0, 2);
    let o = Overflow::default();
    let mut n = 0u64;
    while let Added::Done { .. } = t.add(&Probe::new(n), h, 1, &mut || n as u32, &o, 0) {
        n += 1;
    }
    assert_eq!(t.live() as u64, n);
    assert!(t.live() <= t.capacity() - t.capacity() / 8);
    let r = t.rebuilt(1);
    assert_eq!(r.live() as u64, n);
    for k in 0..n {
        let mut seen = vec![];
        r.for_each(&Probe::new(k), |v| seen.push(v));
        assert_eq!(seen, vec![h | (k << ENTRY_SHIFT) | 1]);
    }
}

#[test]
fn a_grown_table_holds_every_value_and_takes_half_as_many_again_before_it_is_full() {
    let t = Table::for_entries(1000);
    let (h, o) = (holder(3, 1, 0), Overflow::default());
    let mut n = 0u64;
    while let Added::Done { .. } = t.add(&Probe::new(n), h, 1, &mut || n as u32, &o, 0) {
        n += 1;
    }
    assert!(!t.sweep_first(), "a table full of live slots grows");
    let g = t.grown();
    assert_eq!(g.live() as u64, n);
    for k in 0..n {
        let mut seen = vec![];
        g.for_each(&Probe::new(k), |v| seen.push(v));
        assert_eq!(seen, vec![h | (k << ENTRY_SHIFT) | 1]);
    }
    // Room for half as many again before the grown table is full, and less than twice.
    let mut m = n;
    while let Added::Done { .. } = g.add(&Probe::new(m), h, 1, &mut || m as u32, &o, 0) {
        m += 1;
    }
    assert!(2 * m >= 3 * n, "{m} values before full, from {n}");
    assert!(m < 2 * n, "{m} values before full, from {n}: a doubling");
    assert!(2 * g.capacity() >= 3 * t.capacity(), "{} slots from {}", g.capacity(), t.capacity());
}

#[test]
fn a_dead_slot_is_reused_for_another_key_only_once_its_grace_ticket_has_passed() {
    // Two groups, 14 slots, at most 13 used (dead ones included).
    let t = Table::for_entries(0);
    let (o, g) = (Overflow::default(), Grace::default());
    let h = holder(3, 0, 0);
    let count = |t: &Table, k: u64| {
        let mut n = 0;
        t.for_each(&Probe::new(k), |_| n += 1);
        n
    };
    for k in 0..13u64 {
        assert!(matches!(t.add(&Probe::new(k), h, 1, &mut || k as u32, &o, 0), Added::Done { .. }));
    }
    for k in 0..5u64 {
        assert_eq!(t.sub(&Probe::new(k), h, &o, &g), Subbed::Died { entry: k as u32 });
        assert_eq!(count(&t, k), 0);
    }
    assert_eq!((t.live(), t.tombs()), (8, 5));
    // Their ticket (0) has not passed: a new key finds no room.
    assert_eq!(t.add(&Probe::new(100), h, 1, &mut || 100, &o, g.periods_ended()), Added::Full);
    // One grace period (start, second flip, end) passes it: five new keys take the dead
    // slots, and the sixth finds no room again.
    for _ in 0..3 {
        g.advance();
    }
    assert_eq!(g.periods_ended(), 1);
    for k in 100..105u64 {
        assert_eq!(
            t.add(&Probe::new(k), h, 1, &mut || k as u32, &o, 1),
            Added::Done { saturated: false, entry: k as u32 }
        );
    }
    assert_eq!((t.live(), t.tombs()), (13, 0));
    assert_eq!(t.add(&Probe::new(105), h, 1, &mut || 105, &o, 1), Added::Full);
    for k in (0..5).chain(105..106) {
        assert_eq!(count(&t, k), 0, "key {k}");
    }
    for k in (5..13).chain(100..105) {
        assert_eq!(count(&t, k), 1, "key {k}");
    }
}

/// The overflow counts of `t`, group by group.
fn counts(t: &Table) -> Vec<u64> {
    t.ctrl.iter().map(|w| w.load(Ordering::Relaxed) >> OVERFLOW_SHIFT).collect()
}

/// A table sized for 1,000 entries holding keys `0..900` for `h`, key `k` with entry `k`.
fn nine_hundred(h: u64) -> (Table, Overflow, Grace) {
    let t = Table::for_entries(1000);
    let (o, g) = (Overflow::default(), Grace::default());
    for k in 0..900u64 {
        assert!(matches!(t.add(&Probe::new(k), h, 1, &mut || k as u32, &o, 0), Added::Done { .. }));
    }
    (t, o, g)
}

#[test]
fn an_overflow_count_is_the_number_of_live_slots_placed_past_its_group() {
    let h = holder(2, 0, 1);
    let (t, o, g) = nine_hundred(h);
    // Recount from the slots themselves: every live slot adds 1 to each group from its
    // key's home up to its own.
    let expected = |t: &Table| {
        let groups = t.ctrl.len();
        let mut c = vec![0u64; groups];
        for i in t.published_slots() {
            let mut g = Probe::new(t.slots[i].key.load(Ordering::Relaxed)).home(groups);
            while g != i / GROUP {
                c[g] += 1;
                g = next_group(g, groups);
            }
        }
        c
    };
    let before = counts(&t);
    assert!(before.iter().filter(|&&c| c > 0).count() > 10, "the test should exercise overflow: {before:?}");
    assert_eq!(before, expected(&t));
    // Every other key dies: the counts fall with the slots that went past.
    for k in (0..900u64).step_by(2) {
        assert_eq!(t.sub(&Probe::new(k), h, &o, &g), Subbed::Died { entry: k as u32 });
    }
    assert_eq!(counts(&t), expected(&t));
    assert!(counts(&t).iter().sum::<u64>() < before.iter().sum::<u64>());
    // All of them: no group is passed any more, and every probe ends at its home group.
    for k in (1..900u64).step_by(2) {
        assert_eq!(t.sub(&Probe::new(k), h, &o, &g), Subbed::Died { entry: k as u32 });
    }
    assert_eq!(counts(&t), vec![0; t.ctrl.len()]);
    assert_eq!((t.live(), t.tombs()), (0, 900));
}

#[test]
fn a_sweep_frees_only_ripe_dead_slots_of_groups_no_live_slot_went_past() {
    let h = holder(5, 1, 0);
    let (t, o, g) = nine_hundred(h);
    for k in 0..300u64 {
        assert_eq!(t.sub(&Probe::new(k), h, &o, &g), Subbed::Died { entry: k as u32 });
    }
    // Their ticket (0) has not passed: nothing is freed.
    assert_eq!(t.sweep(g.periods_ended()), 0);
    assert_eq!((t.live(), t.tombs()), (600, 300));
    for _ in 0..3 {
        g.advance();
    }
    assert_eq!(g.periods_ended(), 1);
    // Which dead slots a sweep may free, read before it: those of groups with count 0.
    let free: usize = t
        .ctrl
        .iter()
        .map(|w| w.load(Ordering::Relaxed))
        .filter(|&w| !overflowed(w))
        .map(|w| dead_bytes(w).count_ones() as usize)
        .sum();
    let passed = counts(&t);
    assert!(free > 0 && free < 300, "the test should keep some dead slots in passed groups: {free}");
    assert_eq!(t.sweep(1), free);
    assert_eq!((t.live(), t.tombs()), (600, 300 - free));
    assert_eq!(counts(&t), passed, "a sweep changes no count");
    // The freed slots are EMPTY; dead ones are left only where a live slot went past.
    for w in t.ctrl.iter().map(|w| w.load(Ordering::Relaxed)) {
        let dead = dead_bytes(w).count_ones();
        assert!(dead == 0 || overflowed(w), "{w:016x}");
    }
    // Every key is what it was: the dead ones gone, the live ones found once, with their entry.
    for k in 0..900u64 {
        let mut seen = vec![];
        t.for_each(&Probe::new(k), |v| seen.push(v));
        let want = if k < 300 { vec![] } else { vec![h | (k << ENTRY_SHIFT) | 1] };
        assert_eq!(seen, want, "key {k}");
    }
    // A second sweep finds nothing more.
    assert_eq!(t.sweep(1), 0);
}
