//! Ordered mode's lanes, one per subject: what was fetched of a subject and not handed out
//! yet, the delivery of it held by a nack, and the messages of it given back to the server.
//!
//! A subject's messages go out one at a time, in stream order, so a subject waiting for its
//! head (a delivery out, or held by a nack's delay) must not keep the others waiting: the
//! fetched messages of all subjects share one buffer ([`Limits::room`]), and a subject whose
//! head is held fills it with its backlog. So a *stalled* lane (its head held, or messages
//! of it given back) keeps at most [`Limits::lane`] messages; the later ones are given back
//! to the server, a `-NAK` whose delay ends when the head may go out again, instead of being
//! kept. The lane remembers their stream sequences and hands nothing out behind one of them
//! until it has come back (the server redelivers expired naks in stream-sequence order, but
//! a message fetched for the first time may arrive in between), so the subject's order
//! holds. And when the buffer is full and no lane can move (nothing to hand out, nothing
//! out that will settle), the longest lanes give back their tails until a quarter of it is
//! free: intake never stops for every subject because some of them wait.

use idemq_core::adapter::DelayedRedelivery;
use idemq_core::source::Delivery;
use idemq_core::Envelope;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::time::Instant;

/// The shortest delay a given-back message is nakked with: shorter, the backlog of a subject
/// whose head is about to go out again would circle between the server and the source.
pub(crate) const GIVE_BACK_MIN: Duration = Duration::from_secs(1);

/// A fetched message not handed out yet; it becomes a [`Delivery`] when it is.
pub(crate) struct Fetched {
    pub env: Envelope,
    /// The source's handle on it (see `Tracked`).
    pub id: u64,
    /// Its stream sequence.
    pub seq: Option<u64>,
    /// When the stream stored it.
    pub stored_ms: Option<i64>,
}

impl Fetched {
    /// Where it goes in its lane: stream order (a message without a sequence last).
    fn order(&self) -> Order {
        (self.seq.unwrap_or(u64::MAX), self.id)
    }
}

type Order = (u64, u64);

/// How much the lanes keep.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    /// Fetched messages kept across all lanes before intake waits for the engine to take
    /// some (or, when no lane can move, gives back).
    pub room: usize,
    /// Fetched messages a stalled lane keeps.
    pub lane: usize,
    /// The consumer's `max_deliver`: a message delivered that often would not come back if
    /// it were given back, so it is kept.
    pub max_deliver: i64,
}

impl Limits {
    /// Room for four pull batches (64 at least); a stalled lane keeps a quarter of it.
    pub fn new(batch: usize, max_deliver: i64) -> Self {
        let room = batch.saturating_mul(4).max(64);
        Self {
            room,
            lane: (room / 4).max(1),
            max_deliver,
        }
    }

    fn may_give_back(&self, f: &Fetched) -> bool {
        self.max_deliver <= 0 || i64::from(f.env.delivery_count.unwrap_or(1)) < self.max_deliver
    }
}

/// A message to give back: the source stops answering for it and naks it with `delay`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct GiveBack {
    pub id: u64,
    pub seq: Option<u64>,
    pub subject: String,
    pub delay: Duration,
}

/// What intake may do after an arrival.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Room {
    /// Fetch on.
    Open,
    /// The buffer is full and some lane can still move: wait until the engine takes from
    /// it (back-pressure, as with any buffer).
    Full,
    /// Give these back, then ask again.
    GiveBack(Vec<GiveBack>),
}

#[derive(Default)]
struct Lane {
    /// Fetched, not handed out, in stream order.
    kept: BTreeMap<Order, Fetched>,
    /// Stream sequences given back, and when each is due back.
    away: BTreeMap<u64, Instant>,
    /// The latest due time in `away`: what is given back later is due no sooner, so the
    /// server redelivers the lane's messages in their order.
    away_until: Option<Instant>,
    /// A delivery of the subject is out.
    out: bool,
    /// Its delivery is held by a nack until then.
    held_until: Option<Instant>,
}

impl Lane {
    fn stalled(&self) -> bool {
        self.held_until.is_some() || !self.away.is_empty()
    }

    fn idle(&self) -> bool {
        self.kept.is_empty() && self.away.is_empty() && !self.out && self.held_until.is_none()
    }

    /// The first kept message, unless an earlier message of the lane is away.
    fn first_free(&self) -> Option<Order> {
        let (first, _) = self.kept.first_key_value()?;
        match self.away.first_key_value() {
            Some((away, _)) if *away < first.0 => None,
            _ => Some(*first),
        }
    }

    /// The kept message that may go out now: none while one is out or held, nor while an
    /// earlier message of the lane is away.
    fn next(&self) -> Option<Order> {
        if self.out || self.held_until.is_some() {
            return None;
        }
        self.first_free()
    }

    /// Will free room without a give-back: its first kept message goes out now, or once
    /// the delivery out is settled. (Not while a delivery is held, nor while an earlier
    /// message is away: that one would have to be fetched first.)
    fn moving(&self) -> bool {
        self.held_until.is_none() && self.first_free().is_some()
    }

    fn forget_away(&mut self, seq: u64) -> bool {
        let was = self.away.remove(&seq).is_some();
        if self.away.is_empty() {
            self.away_until = None;
        }
        was
    }

    /// Gives back the latest kept messages until `keep` are left (fewer when some may not be
    /// given back), each due back when the lane's head may go out again.
    fn give_back_tail(
        &mut self,
        subject: &str,
        keep: usize,
        now: Instant,
        lim: &Limits,
    ) -> Vec<GiveBack> {
        let excess = self.kept.len().saturating_sub(keep);
        if excess == 0 {
            return Vec::new();
        }
        let at = [self.held_until, self.away_until]
            .into_iter()
            .flatten()
            .fold(now + GIVE_BACK_MIN, Instant::max);
        let tail: Vec<Order> = self
            .kept
            .iter()
            .rev()
            .filter(|(_, f)| lim.may_give_back(f))
            .map(|(k, _)| *k)
            .take(excess)
            .collect();
        let mut out = Vec::with_capacity(tail.len());
        for k in tail {
            let Some(f) = self.kept.remove(&k) else {
                continue;
            };
            if let Some(s) = f.seq {
                self.away.insert(s, at);
                self.away_until = Some(at);
            }
            out.push(GiveBack {
                id: f.id,
                seq: f.seq,
                subject: subject.to_string(),
                delay: at.saturating_duration_since(now),
            });
        }
        out
    }
}

/// Every subject's lane (ordered mode).
#[derive(Default)]
pub(crate) struct Lanes {
    lanes: HashMap<String, Lane>,
    /// Fetched messages kept, over all lanes.
    kept: usize,
    /// Messages given back and not come back, over all lanes.
    away: usize,
    /// Deliveries held by a nack, until their delay ends.
    held: DelayedRedelivery<Delivery, String>,
}

impl Lanes {
    /// Keeps a fetched message in its subject's lane; if it was given back, it is back.
    pub fn take_in(&mut self, f: Fetched) {
        let lane = self.lanes.entry(f.env.source.name.clone()).or_default();
        if f.seq.is_some_and(|s| lane.forget_away(s)) {
            self.away -= 1;
        }
        lane.kept.insert(f.order(), f);
        self.kept += 1;
    }

    /// What intake may do now: stalled lanes give back what they keep beyond their bound;
    /// a full buffer waits while some lane can move, and otherwise the longest lanes give
    /// back their tails until a quarter of it is free. A buffer full of messages none of
    /// which may be given back (`max_deliver`) takes more rather than stop every subject.
    pub fn room(&mut self, now: Instant, lim: &Limits) -> Room {
        let mut back = Vec::new();
        for (subject, lane) in self.lanes.iter_mut() {
            if lane.stalled() && lane.kept.len() > lim.lane {
                back.extend(lane.give_back_tail(subject, lim.lane, now, lim));
            }
        }
        self.kept -= back.len();
        let moving = self.lanes.values().any(Lane::moving);
        if self.kept >= lim.room && !moving {
            let target = lim.room - lim.room / 4;
            let lens: Vec<usize> = self.lanes.values().map(|l| l.kept.len()).collect();
            let level = water_level(&lens, target);
            let before = back.len();
            for (subject, lane) in self.lanes.iter_mut() {
                back.extend(lane.give_back_tail(subject, level, now, lim));
            }
            self.kept -= back.len() - before;
        }
        self.away += back.iter().filter(|g| g.seq.is_some()).count();
        if !back.is_empty() {
            Room::GiveBack(back)
        } else if self.kept >= lim.room && moving {
            Room::Full
        } else {
            Room::Open
        }
    }

    /// Up to `max` to hand out: held deliveries whose delay ended, then the next kept
    /// message of each lane that may move, in stream order.
    pub fn hand_out(&mut self, now: Instant, max: usize) -> (Vec<Delivery>, Vec<Fetched>) {
        let held = self.held.pop_due(now, max);
        for d in &held {
            let subject = &d.envelope.source.name;
            let still_held = self.held.holds(subject);
            let lane = self.lanes.entry(subject.clone()).or_default();
            lane.out = true;
            if !still_held {
                lane.held_until = None;
            }
        }
        let mut heads: Vec<(Order, &String)> = self
            .lanes
            .iter()
            .filter_map(|(subject, lane)| lane.next().map(|o| (o, subject)))
            .collect();
        heads.sort_unstable();
        let subjects: Vec<String> = heads
            .into_iter()
            .take(max.saturating_sub(held.len()))
            .map(|(_, s)| s.clone())
            .collect();
        let mut fetched = Vec::with_capacity(subjects.len());
        for s in subjects {
            if let Some(lane) = self.lanes.get_mut(&s) {
                if let Some((_, f)) = lane.kept.pop_first() {
                    lane.out = true;
                    self.kept -= 1;
                    fetched.push(f);
                }
            }
        }
        (held, fetched)
    }

    /// Holds the subject's delivery until `due` (a nack): nothing newer of it goes out
    /// before it does.
    pub fn hold(&mut self, subject: String, d: Delivery, due: Instant) {
        let lane = self.lanes.entry(subject.clone()).or_default();
        lane.out = false;
        lane.held_until = Some(lane.held_until.map_or(due, |t| t.max(due)));
        self.held.push(subject, d, due);
    }

    /// The subject's delivery is settled: its next may go out.
    pub fn settled(&mut self, subject: &str) {
        if let Some(lane) = self.lanes.get_mut(subject) {
            lane.out = false;
            if lane.idle() {
                self.lanes.remove(subject);
            }
        }
    }

    /// Stops waiting for given-back messages due back at `due_before` or earlier: the
    /// server did not redeliver them (another consumer of the durable settled them, or
    /// they were removed from the stream). Returns them by subject.
    pub fn expire_away(&mut self, due_before: Instant) -> Vec<(String, Vec<u64>)> {
        let mut gone = Vec::new();
        for (subject, lane) in self.lanes.iter_mut() {
            let seqs: Vec<u64> = lane
                .away
                .iter()
                .filter(|(_, due)| **due <= due_before)
                .map(|(s, _)| *s)
                .collect();
            if seqs.is_empty() {
                continue;
            }
            for s in &seqs {
                lane.forget_away(*s);
            }
            self.away -= seqs.len();
            gone.push((subject.clone(), seqs));
        }
        self.lanes.retain(|_, l| !l.idle());
        gone
    }

    /// When the next held delivery is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.held.next_due()
    }

    /// Messages given back and not come back.
    pub fn away(&self) -> usize {
        self.away
    }

    /// The subjects whose head is held or whose messages are given back, in name order.
    pub fn stalled(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .lanes
            .iter()
            .filter(|(_, l)| l.stalled())
            .map(|(s, _)| s.as_str())
            .collect();
        out.sort_unstable();
        out
    }

    /// Empties the lanes (the source closes): the held deliveries are returned, to be
    /// dropped where that is safe; the kept messages are plain data.
    pub fn drain(&mut self) -> Vec<Delivery> {
        self.lanes.clear();
        self.kept = 0;
        self.away = 0;
        self.held.drain_lanes(|_| true)
    }
}

/// The largest per-lane count `c` such that the lanes keep at most `target` messages when
/// each keeps no more than `c`.
fn water_level(lens: &[usize], target: usize) -> usize {
    let (mut lo, mut hi) = (0, lens.iter().copied().max().unwrap_or(0));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if lens.iter().map(|l| (*l).min(mid)).sum::<usize>() <= target {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemq_core::adapter::SettleRecorder;

    fn fetched(subject: &str, seq: u64) -> Fetched {
        Fetched {
            env: Envelope::new(crate::NATS, subject, "{}"),
            id: seq,
            seq: Some(seq),
            stored_ms: None,
        }
    }

    fn held(subject: &str) -> Delivery {
        Delivery::new(
            Envelope::new(crate::NATS, subject, "{}"),
            Box::new(SettleRecorder::new().0),
        )
    }

    fn seqs(fs: &[Fetched]) -> Vec<u64> {
        fs.iter().filter_map(|f| f.seq).collect()
    }

    fn given(room: Room) -> Vec<GiveBack> {
        match room {
            Room::GiveBack(back) => back,
            other => panic!("expected a give-back, got {other:?}"),
        }
    }

    /// Room 64, a stalled lane keeps 16.
    fn limits() -> Limits {
        Limits::new(16, -1)
    }

    #[test]
    fn a_held_subject_keeps_its_bound_and_gives_back_the_rest_until_its_head_is_due() {
        let (lim, now) = (limits(), Instant::now());
        let mut lanes = Lanes::default();
        lanes.take_in(fetched("a", 1));
        let (_, out) = lanes.hand_out(now, 10);
        assert_eq!(seqs(&out), [1]);
        let due = now + Duration::from_secs(30);
        lanes.hold("a".into(), held("a"), due);
        for s in 2..=40 {
            lanes.take_in(fetched("a", s));
        }
        let back = given(lanes.room(now, &lim));
        let mut back_seqs: Vec<u64> = back.iter().filter_map(|g| g.seq).collect();
        back_seqs.sort_unstable();
        assert_eq!(back_seqs, (18..=40).collect::<Vec<_>>(), "a keeps 2..=17");
        assert!(back
            .iter()
            .all(|g| g.delay == Duration::from_secs(30) && g.subject == "a"));
        assert_eq!((lanes.kept, lanes.away()), (16, 23));
        assert_eq!(lanes.stalled(), ["a"]);
        // Another subject flows meanwhile.
        lanes.take_in(fetched("b", 41));
        assert_eq!(lanes.room(now, &lim), Room::Open);
        let (h, out) = lanes.hand_out(now, 10);
        assert!(h.is_empty());
        assert_eq!(seqs(&out), [41], "a waits for its held head");
        // Given back later, a message is due no sooner than those given back before it.
        lanes.take_in(fetched("a", 42));
        let later = given(lanes.room(now + Duration::from_secs(1), &lim));
        assert_eq!(later.len(), 1);
        assert_eq!(later[0].delay, Duration::from_secs(29));
    }

    #[test]
    fn nothing_goes_out_behind_a_message_given_back_until_it_is_back() {
        let (lim, now) = (limits(), Instant::now());
        let mut lanes = Lanes::default();
        lanes.take_in(fetched("a", 1));
        let (_, first) = lanes.hand_out(now, 10);
        lanes.hold("a".into(), held("a"), now);
        for s in 2..=20 {
            lanes.take_in(fetched("a", s));
        }
        let back = given(lanes.room(now, &lim));
        assert_eq!(back.len(), 3, "18, 19, 20");
        // The head goes out again and is settled: 2..=17 go out one by one, in order.
        let (again, none) = lanes.hand_out(now, 10);
        assert_eq!((again.len(), none.len()), (1, 0));
        lanes.settled("a");
        let mut went = Vec::new();
        loop {
            let (_, out) = lanes.hand_out(now, 10);
            if out.is_empty() {
                break;
            }
            assert_eq!(out.len(), 1, "one of a at a time");
            went.extend(seqs(&out));
            lanes.settled("a");
        }
        assert_eq!(went, (2..=17).collect::<Vec<_>>());
        // A newer message of a arrived before the given-back ones came back: it waits.
        lanes.take_in(fetched("a", 21));
        assert!(lanes.hand_out(now, 10).1.is_empty(), "18 is not back yet");
        for s in [19, 18, 20] {
            lanes.take_in(fetched("a", s));
        }
        assert_eq!(lanes.away(), 0);
        let mut went = Vec::new();
        loop {
            let (_, out) = lanes.hand_out(now, 10);
            if out.is_empty() {
                break;
            }
            went.extend(seqs(&out));
            lanes.settled("a");
        }
        assert_eq!(went, [18, 19, 20, 21], "back in stream order");
        assert!(lanes.lanes.is_empty(), "an idle lane is forgotten");
        drop(first);
    }

    #[test]
    fn a_full_buffer_waits_while_a_lane_can_move() {
        let (lim, now) = (limits(), Instant::now());
        let mut lanes = Lanes::default();
        lanes.take_in(fetched("a", 1));
        let _out = lanes.hand_out(now, 10);
        for s in 2..=65 {
            lanes.take_in(fetched("a", s));
        }
        assert_eq!(
            lanes.room(now, &lim),
            Room::Full,
            "a's head is out: settling it frees room"
        );
        lanes.settled("a");
        assert_eq!(lanes.room(now, &lim), Room::Full, "a's next can go out");
    }

    #[test]
    fn a_buffer_full_of_waiting_lanes_gives_back_the_longest_tails() {
        // No bound per lane here: only the buffer's.
        let lim = Limits {
            room: 64,
            lane: 64,
            max_deliver: -1,
        };
        let now = Instant::now();
        let mut lanes = Lanes::default();
        let mut seq = 0;
        for (subject, n) in [("a", 40), ("b", 20), ("c", 4)] {
            seq += 1;
            lanes.take_in(fetched(subject, seq));
            let _ = lanes.hand_out(now, 10);
            lanes.hold(subject.into(), held(subject), now + Duration::from_secs(5));
            for _ in 0..n {
                seq += 1;
                lanes.take_in(fetched(subject, seq));
            }
        }
        assert_eq!(lanes.kept, 64);
        let back = given(lanes.room(now, &lim));
        let count = |s: &str| back.iter().filter(|g| g.subject == s).count();
        // 48 kept: no lane more than 24, so only a gives back.
        assert_eq!((count("a"), count("b"), count("c")), (16, 0, 0));
        assert_eq!(lanes.kept, 48);
        assert_eq!(lanes.room(now, &lim), Room::Open);
    }

    #[test]
    fn a_message_at_max_deliver_is_kept_not_given_back() {
        let lim = Limits {
            room: 64,
            lane: 2,
            max_deliver: 5,
        };
        let now = Instant::now();
        let mut lanes = Lanes::default();
        lanes.take_in(fetched("a", 1));
        let _ = lanes.hand_out(now, 10);
        lanes.hold("a".into(), held("a"), now);
        for s in 2..=5 {
            let mut f = fetched("a", s);
            f.env.delivery_count = Some(if s == 5 { 5 } else { 1 });
            lanes.take_in(f);
        }
        let back = given(lanes.room(now, &lim));
        assert_eq!(
            back.iter().filter_map(|g| g.seq).collect::<Vec<_>>(),
            [4, 3],
            "5 would not come back: 3 and 4 go instead"
        );
    }

    #[test]
    fn a_message_that_never_comes_back_stops_holding_its_subject_once_expired() {
        let (lim, now) = (limits(), Instant::now());
        let mut lanes = Lanes::default();
        lanes.take_in(fetched("a", 1));
        let _ = lanes.hand_out(now, 10);
        lanes.hold("a".into(), held("a"), now);
        for s in 2..=18 {
            lanes.take_in(fetched("a", s));
        }
        assert_eq!(given(lanes.room(now, &lim)).len(), 1, "18");
        let (again, _) = lanes.hand_out(now, 10);
        assert_eq!(again.len(), 1);
        lanes.settled("a");
        for _ in 2..=17 {
            assert_eq!(lanes.hand_out(now, 10).1.len(), 1);
            lanes.settled("a");
        }
        lanes.take_in(fetched("a", 19));
        assert!(lanes.hand_out(now, 10).1.is_empty(), "19 waits for 18");
        assert!(lanes.expire_away(now).is_empty(), "18 is not due yet");
        let gone = lanes.expire_away(now + GIVE_BACK_MIN);
        assert_eq!(gone, [("a".to_string(), vec![18])]);
        assert_eq!(seqs(&lanes.hand_out(now, 10).1), [19]);
    }

    #[test]
    fn water_level_is_the_highest_cap_within_the_target() {
        assert_eq!(water_level(&[40, 20, 4], 48), 24);
        assert_eq!(water_level(&[40, 20, 4], 64), 40);
        assert_eq!(water_level(&[10, 10], 5), 2);
        assert_eq!(water_level(&[], 5), 0);
    }
}
