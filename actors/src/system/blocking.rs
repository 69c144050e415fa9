//! Waiting for an actor's answer from a thread outside the runtime (an engine's scheduler, a
//! command-line tool), always with a deadline.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use actix::dev::ToEnvelope;
use actix::{Actor, Addr, Handler, Message};

struct ThreadWaker(thread::Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs `future` on the calling thread until it is ready or `timeout` passes (`None`). For
/// futures that need no executor of their own, such as actix's `Addr::send`, which answers
/// through a channel. Never call it from a thread of the runtime: the answer could not come.
///
/// ```
/// use std::time::Duration;
/// use kvhandoff_actors::system::blocking::block_on_timeout;
/// assert_eq!(block_on_timeout(async { 7 }, Duration::from_millis(10)), Some(7));
/// assert_eq!(block_on_timeout(std::future::pending::<()>(), Duration::from_millis(10)), None);
/// ```
pub fn block_on_timeout<F: Future>(future: F, timeout: Duration) -> Option<F::Output> {
    let deadline = Instant::now() + timeout;
    let waker = Waker::from(Arc::new(ThreadWaker(thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return Some(out);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        thread::park_timeout(deadline - now);
    }
}

/// Sends `message` to `actor` and waits at most `timeout` for the answer; `None` if none came
/// in time or the actor is gone.
pub fn ask<A, M>(actor: &Addr<A>, message: M, timeout: Duration) -> Option<M::Result>
where
    A: Actor + Handler<M>,
    A::Context: ToEnvelope<A, M>,
    M: Message + Send + 'static,
    M::Result: Send,
{
    block_on_timeout(actor.send(message), timeout)?.ok()
}
