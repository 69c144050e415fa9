//! `Runtime`: an actix system on its own thread, for engines that call in from their own
//! threads (the way an engine's scheduler calls its connector's hooks).

use std::sync::mpsc;
use std::thread::JoinHandle;

use actix::{Arbiter, ArbiterHandle, System};

use super::{start_rank, Directory, Handshaker, Placement, RankHandle, RankOptions, RankSetup};
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

    /// Starts one rank's actors as `options` say and returns its handle.
    ///
    /// # Errors
    /// [`RuntimeError::Stopped`] if the runtime is gone; [`RuntimeError::SideChannel`] if a
    /// TCP side channel cannot listen.
    pub fn add_rank<T>(
        &mut self,
        setup: RankSetup<T>,
        options: RankOptions,
    ) -> Result<RankHandle, RuntimeError>
    where
        T: Transport + Unpin + Send + 'static,
    {
        let handshaker = options
            .handshaker
            .unwrap_or_else(|| Handshaker::InProcess(self.directory.clone()));
        let started = match options.placement {
            Placement::Shared => {
                let (tx, rx) = mpsc::channel();
                let spawned = self.arbiter.spawn_fn(move || {
                    let _ = tx.send(start_rank(setup, handshaker, None));
                });
                if !spawned {
                    return Err(RuntimeError::Stopped);
                }
                rx.recv().map_err(|_| RuntimeError::Stopped)?
            }
            Placement::OwnThread => {
                let arbiter = self.new_arbiter()?;
                self.start_on(arbiter, move || start_rank(setup, handshaker, None))?
            }
            Placement::OwnThreads => {
                let rank_arbiter = self.new_arbiter()?;
                let transport_arbiter = self.new_arbiter()?;
                let transport = transport_arbiter.handle();
                self.arbiters.push(transport_arbiter);
                self.start_on(rank_arbiter, move || {
                    start_rank(setup, handshaker, Some(&transport))
                })?
            }
        };
        started.map_err(RuntimeError::SideChannel)
    }

    /// Runs `start` on `arbiter` (which the runtime keeps) and returns the rank it started.
    fn start_on(
        &mut self,
        arbiter: Arbiter,
        start: impl FnOnce() -> std::io::Result<RankHandle> + Send + 'static,
    ) -> Result<std::io::Result<RankHandle>, RuntimeError> {
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
