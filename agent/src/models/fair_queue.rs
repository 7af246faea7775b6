//! The concurrency slots of one model's worker, shared fairly across users.
//!
//! A worker takes `max_concurrency` calls at a time; the rest wait here (their number is
//! bounded by the caller: `queue_len`, answered 429 past it). When a slot frees, it goes to the
//! waiting user that was served least recently, and within one user to that user's oldest
//! call. So one user's burst of 500 calls does not queue ahead of another user's single call:
//! that call waits for at most the slot that frees next (about one call's time with one slot).
//!
//! A waiting call that is given up (its client went away, its deadline passed) leaves its place
//! at once; a slot handed to a call that is already gone is handed on.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use tokio::sync::oneshot;

/// The slots of one worker and the calls waiting for them.
#[derive(Debug)]
pub struct FairQueue {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    free: usize,
    /// Grants so far: a user's `last_served` is the grant number of its latest slot.
    grants: u64,
    next_id: u64,
    waiting: usize,
    /// Users that hold a slot or wait for one (a user with neither is forgotten).
    users: HashMap<String, UserState>,
}

#[derive(Debug, Default)]
struct UserState {
    waiters: VecDeque<(u64, oneshot::Sender<SlotPermit>)>,
    held: usize,
    last_served: u64,
}

/// One slot, held by `user`; given back (and handed to the next waiter) when dropped.
#[derive(Debug)]
pub struct SlotPermit {
    queue: Option<Arc<FairQueue>>,
    user: String,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        if let Some(q) = self.queue.take() {
            q.release(&self.user);
        }
    }
}

impl FairQueue {
    pub fn new(slots: usize) -> Arc<FairQueue> {
        Arc::new(FairQueue { inner: Mutex::new(Inner { free: slots, ..Inner::default() }) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a panic elsewhere; every update below is complete.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Calls waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// Slots free now.
    pub fn free(&self) -> usize {
        self.lock().free
    }

    /// Waits for a slot for `user`. Dropping the future gives up the place in the queue.
    pub fn acquire(self: &Arc<Self>, user: &str) -> Acquire {
        let mut g = self.lock();
        let inner = &mut *g;
        if inner.free > 0 && inner.waiting == 0 {
            inner.free -= 1;
            inner.grants += 1;
            let grant = inner.grants;
            // Looked up before inserting: a user with calls in flight costs no new key.
            let u = match inner.users.get_mut(user) {
                Some(u) => u,
                None => inner.users.entry(user.to_string()).or_default(),
            };
            u.held += 1;
            u.last_served = grant;
            return Acquire { state: AcquireState::Ready(Some(SlotPermit { queue: Some(self.clone()), user: user.to_string() })) };
        }
        inner.next_id += 1;
        let id = inner.next_id;
        let (tx, rx) = oneshot::channel();
        inner.users.entry(user.to_string()).or_default().waiters.push_back((id, tx));
        inner.waiting += 1;
        Acquire { state: AcquireState::Waiting { rx, queue: self.clone(), user: user.to_string(), id } }
    }

    /// Gives back a slot of `user` and hands free slots to the next waiters.
    fn release(self: &Arc<Self>, user: &str) {
        let handed = {
            let mut g = self.lock();
            let inner = &mut *g;
            inner.free += 1;
            if let Some(u) = inner.users.get_mut(user) {
                u.held = u.held.saturating_sub(1);
                if u.held == 0 && u.waiters.is_empty() {
                    inner.users.remove(user);
                }
            }
            self.hand_out(inner)
        };
        for (tx, permit) in handed {
            // A waiter that is gone returns the permit, whose drop hands the slot on.
            let _ = tx.send(permit);
        }
    }

    /// Takes free slots for waiters, least recently served user first.
    fn hand_out(self: &Arc<Self>, inner: &mut Inner) -> Vec<(oneshot::Sender<SlotPermit>, SlotPermit)> {
        let mut out = Vec::new();
        while inner.free > 0 && inner.waiting > 0 {
            let next = inner.users.iter().filter_map(|(name, u)| u.waiters.front().map(|(id, _)| (u.last_served, *id, name.clone()))).min();
            let Some((_, _, name)) = next else { break };
            let Some(u) = inner.users.get_mut(&name) else { break };
            let Some((_, tx)) = u.waiters.pop_front() else { break };
            inner.free -= 1;
            inner.waiting -= 1;
            inner.grants += 1;
            u.held += 1;
            u.last_served = inner.grants;
            out.push((tx, SlotPermit { queue: Some(self.clone()), user: name }));
        }
        out
    }

    /// Removes a waiter that gave up (no-op if it was handed a slot meanwhile).
    fn cancel(&self, user: &str, id: u64) {
        let mut g = self.lock();
        let inner = &mut *g;
        let Some(u) = inner.users.get_mut(user) else { return };
        let before = u.waiters.len();
        u.waiters.retain(|(w, _)| *w != id);
        if u.waiters.len() < before {
            inner.waiting -= 1;
        }
        if u.held == 0 && u.waiters.is_empty() {
            inner.users.remove(user);
        }
    }
}

/// The future of [`FairQueue::acquire`].
#[derive(Debug)]
pub struct Acquire {
    state: AcquireState,
}

#[derive(Debug)]
enum AcquireState {
    Ready(Option<SlotPermit>),
    Waiting { rx: oneshot::Receiver<SlotPermit>, queue: Arc<FairQueue>, user: String, id: u64 },
    Done,
}

impl Future for Acquire {
    type Output = SlotPermit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<SlotPermit> {
        let this = &mut *self;
        match &mut this.state {
            AcquireState::Ready(p) => match p.take() {
                Some(p) => {
                    this.state = AcquireState::Done;
                    Poll::Ready(p)
                }
                None => Poll::Pending,
            },
            AcquireState::Waiting { rx, .. } => match Pin::new(rx).poll(cx) {
                Poll::Ready(Ok(p)) => {
                    this.state = AcquireState::Done;
                    Poll::Ready(p)
                }
                // The sender lives in the queue until a slot is handed over; a queue dropped
                // with waiters cannot happen while this future holds an Arc of it.
                Poll::Ready(Err(_)) => Poll::Pending,
                Poll::Pending => Poll::Pending,
            },
            AcquireState::Done => Poll::Pending,
        }
    }
}

impl Drop for Acquire {
    fn drop(&mut self) {
        if let AcquireState::Waiting { rx, queue, user, id } = &mut self.state {
            queue.cancel(user, *id);
            // A slot handed over just before: give it back (its drop hands it on).
            rx.close();
            if let Ok(p) = rx.try_recv() {
                drop(p);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    /// Spawns a call of `user` that takes a slot, records its turn, holds it until told.
    fn call(
        q: &Arc<FairQueue>,
        user: &str,
        tag: String,
        log: Arc<Mutex<Vec<String>>>,
    ) -> (tokio::task::JoinHandle<()>, tokio::sync::oneshot::Sender<()>) {
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        let fut = q.acquire(user);
        let h = tokio::spawn(async move {
            let p = fut.await;
            log.lock().unwrap().push(tag);
            let _ = done_rx.await;
            drop(p);
        });
        (h, done_tx)
    }

    #[tokio::test]
    async fn a_burst_of_one_user_does_not_queue_ahead_of_another() {
        let q = FairQueue::new(1);
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut a = Vec::new();
        for i in 0..20 {
            a.push(call(&q, "alice", format!("a{i}"), log.clone()));
        }
        settle().await;
        let b = call(&q, "bob", "b0".into(), log.clone());
        settle().await;
        assert_eq!(q.waiting(), 20, "19 of alice's and bob's wait");
        // alice's first call ends: bob's call is next, not alice's second.
        let mut a = a.into_iter();
        let (h, done) = a.next().unwrap();
        done.send(()).unwrap();
        h.await.unwrap();
        settle().await;
        assert_eq!(*log.lock().unwrap(), vec!["a0".to_string(), "b0".to_string()]);
        b.1.send(()).unwrap();
        b.0.await.unwrap();
        for (h, done) in a {
            settle().await;
            done.send(()).unwrap();
            h.await.unwrap();
        }
        let order = log.lock().unwrap().clone();
        let want: Vec<String> = ["a0", "b0"].iter().map(|s| s.to_string()).chain((1..20).map(|i| format!("a{i}"))).collect();
        assert_eq!(order, want, "alice's own calls stay in their order");
        assert_eq!((q.free(), q.waiting()), (1, 0));
        assert!(q.lock().users.is_empty(), "idle users are forgotten");
    }

    #[tokio::test]
    async fn users_take_turns() {
        let q = FairQueue::new(1);
        let held = q.acquire("x").await;
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (user, tag) in [("alice", "a0"), ("alice", "a1"), ("alice", "a2"), ("bob", "b0"), ("bob", "b1"), ("bob", "b2"), ("carol", "c0")]
        {
            let fut = q.acquire(user);
            let log = log.clone();
            // Each call ends as soon as it has its slot.
            tasks.push(tokio::spawn(async move {
                let p = fut.await;
                log.lock().unwrap().push(tag);
                drop(p);
            }));
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        // Users never served go in order of arrival; then the least recently served first.
        assert_eq!(*log.lock().unwrap(), vec!["a0", "b0", "c0", "a1", "b1", "a2", "b2"]);
        assert_eq!((q.free(), q.waiting()), (1, 0));
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_frees_its_place() {
        let q = FairQueue::new(1);
        let held = q.acquire("alice").await;
        let gone = q.acquire("bob");
        let kept = q.acquire("carol");
        assert_eq!(q.waiting(), 2);
        // bob's call times out while waiting.
        let r = tokio::time::timeout(Duration::from_millis(10), gone).await;
        assert!(r.is_err());
        assert_eq!(q.waiting(), 1, "bob's place is given up");
        drop(held);
        let p = tokio::time::timeout(Duration::from_secs(1), kept).await.expect("carol gets the slot");
        assert_eq!(p.user, "carol");
        drop(p);
        assert_eq!((q.free(), q.waiting()), (1, 0));
        assert!(q.lock().users.is_empty());
    }

    #[tokio::test]
    async fn a_slot_handed_to_a_waiter_that_is_gone_is_handed_on() {
        let q = FairQueue::new(1);
        let held = q.acquire("alice").await;
        let gone = q.acquire("bob");
        let next = q.acquire("carol");
        // The slot is handed to bob while his future is not polled, then he gives up.
        drop(held);
        assert_eq!(q.free(), 0, "the slot went to bob");
        drop(gone);
        let p = tokio::time::timeout(Duration::from_secs(1), next).await.expect("carol gets the slot bob did not take");
        drop(p);
        assert_eq!((q.free(), q.waiting()), (1, 0));
    }
}
