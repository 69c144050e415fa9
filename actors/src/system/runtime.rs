//! `Runtime`: an actix system on its own thread, for engines that call in from their own
//! threads (the way an engine's scheduler calls its connector's hooks).

use std::sync::mpsc;
use std::thread::JoinHandle;

use actix::{Arbiter, ArbiterHandle, System};

use super::{
    start_rank, start_rank_split, start_rank_with, Directory, Handshaker, RankHandle, RankSetup,
};
use crate::transport::Transport;

/// Why the runtime could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The runtime thread could not be started.
    #[error("could not start the runtime thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// The runtime thread is gone (stopped or panicked).
    #[error("the runtime has stopped")]
    Stopped,
    /// The rank's side channel could not listen.
    #[error("the side channel could not start: {0}")]
    SideChannel(std::io::Error),
}

/// A running actix system hosting engine ranks.
///
/// ```
/// use kvhandoff_actors::system::Runtime;
/// let runtime = Runtime::start().unwrap();
/// runtime.shutdown();
/// ```
pub struct Runtime {
    system: System,
    arbiter: ArbiterHandle,
    thread: Option<JoinHandle<()>>,
    directory: Directory,
    /// Arbiters started for ranks that run on threads of their own.
    arbiters: Vec<Arbiter>,
}

impl Runtime {
    /// Starts the system on a new thread named `kvhandoff-runtime`.
    ///
    /// # Errors
    /// [`RuntimeError`] if the thread cannot start.
    pub fn start() -> Result<Runtime, RuntimeError> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kvhandoff-runtime".into())
            .spawn(move || {
                let system = System::new();
                let handle = (System::current(), actix::Arbiter::current());
                if tx.send(handle).is_ok() {
                    // Runs until `System::stop`.
                    let _ = system.run();
                }
            })?;
        let (system, arbiter) = rx.recv().map_err(|_| RuntimeError::Stopped)?;
        Ok(Runtime {
            system,
            arbiter,
            thread: Some(thread),
            directory: Directory::new(),
            arbiters: Vec::new(),
        })
    }

    /// The directory in which this runtime's ranks find each other.
    pub fn directory(&self) -> &Directory {
        &self.directory
    }

    /// Starts one rank's actors on the runtime and returns its handle.
    ///
    /// # Errors
    /// [`RuntimeError::Stopped`] if the runtime is gone.
    pub fn add_rank<T>(&self, setup: RankSetup<T>) -> Result<RankHandle, RuntimeError>
    where
        T: Transport + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let directory = self.directory.clone();
        let spawned = self.arbiter.spawn_fn(move || {
            let _ = tx.send(start_rank(setup, &directory));
        });
        if !spawned {
            return Err(RuntimeError::Stopped);
        }
        rx.recv().map_err(|_| RuntimeError::Stopped)
    }

    /// Starts one rank's actors on a new arbiter thread of their own (in the same system, found
    /// through the same [`Directory`]) and returns its handle. Ranks added this way run in
    /// parallel with the runtime's other ranks, the way ranks of separate engine processes do.
    ///
    /// # Errors
    /// [`RuntimeError::Stopped`] if the runtime is gone.
    pub fn add_rank_on_own_thread<T>(
        &mut self,
        setup: RankSetup<T>,
    ) -> Result<RankHandle, RuntimeError>
    where
        T: Transport + Unpin + Send + 'static,
    {
        let arbiter = self.new_arbiter()?;
        let directory = self.directory.clone();
        self.start_on(arbiter, move || start_rank(setup, &directory))
    }

    /// Like [`Self::add_rank_on_own_thread`], with the rank's writer (its transport calls) on a
    /// second thread of its own: the endpoint's work and the transport's run in parallel.
    ///
    /// # Errors
    /// [`RuntimeError::Stopped`] if the runtime is gone.
    pub fn add_rank_on_own_threads<T>(
        &mut self,
        setup: RankSetup<T>,
    ) -> Result<RankHandle, RuntimeError>
    where
        T: Transport + Unpin + Send + 'static,
    {
        let rank_arbiter = self.new_arbiter()?;
        let writer_arbiter = self.new_arbiter()?;
        let writer = writer_arbiter.handle();
        self.arbiters.push(writer_arbiter);
        let directory = self.directory.clone();
        self.start_on(rank_arbiter, move || {
            start_rank_split(setup, &directory, &writer)
        })
    }

    /// Runs `start` on `arbiter` (which the runtime keeps) and returns the rank it started.
    fn start_on(
        &mut self,
        arbiter: Arbiter,
        start: impl FnOnce() -> RankHandle + Send + 'static,
    ) -> Result<RankHandle, RuntimeError> {
        let (tx, rx) = mpsc::channel();
        let spawned = arbiter.spawn_fn(move || {
            let _ = tx.send(start());
        });
        self.arbiters.push(arbiter);
        if !spawned {
            return Err(RuntimeError::Stopped);
        }
        rx.recv().map_err(|_| RuntimeError::Stopped)
    }

    /// A new arbiter thread of the system (made inside the system's thread, which registers it
    /// with the system).
    fn new_arbiter(&self) -> Result<Arbiter, RuntimeError> {
        let (tx, rx) = mpsc::channel();
        let spawned = self.arbiter.spawn_fn(move || {
            let _ = tx.send(Arbiter::new());
        });
        if !spawned {
            return Err(RuntimeError::Stopped);
        }
        rx.recv().map_err(|_| RuntimeError::Stopped)
    }

    /// Starts one rank's actors with the given [`Handshaker`] (for example a TCP side channel)
    /// and returns its handle.
    ///
    /// # Errors
    /// [`RuntimeError::Stopped`] if the runtime is gone; [`RuntimeError::SideChannel`] if the
    /// side channel cannot listen.
    pub fn add_rank_with<T>(
        &self,
        setup: RankSetup<T>,
        handshaker: Handshaker,
    ) -> Result<RankHandle, RuntimeError>
    where
        T: Transport + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::channel();
        let spawned = self.arbiter.spawn_fn(move || {
            let _ = tx.send(start_rank_with(setup, handshaker));
        });
        if !spawned {
            return Err(RuntimeError::Stopped);
        }
        rx.recv()
            .map_err(|_| RuntimeError::Stopped)?
            .map_err(RuntimeError::SideChannel)
    }

    /// Stops the system and waits for its thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        for arbiter in self.arbiters.drain(..) {
            arbiter.stop();
            let _ = arbiter.join();
        }
        self.system.stop();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop();
    }
}
