//! Hooks only tests use, compiled with the feature `test-hooks` alone (the command line
//! enables it with its own `test-hooks`; `kvhandoff node --stop-self-after` and
//! `--repeat-handshake-ms` exist only then). Without the feature the types below are empty and
//! their hooks never fire.

use std::thread::JoinHandle;
#[cfg(feature = "test-hooks")]
use std::time::Instant;

#[cfg(feature = "test-hooks")]
use kvhandoff_actors::system::Connect;
#[cfg(feature = "test-hooks")]
use kvhandoff_protocol::{driver::PeerInfo, PeerAddr};

/// TEST HOOK of the kill tests: the request after whose last call the process stops itself
/// with SIGSTOP ([`StopAfter::stop_here`]). Without the feature `test-hooks`: never.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct StopAfter(#[cfg(feature = "test-hooks")] Option<usize>);

impl StopAfter {
    /// No request: the process never stops itself.
    pub(crate) const NEVER: Self = Self(
        #[cfg(feature = "test-hooks")]
        None,
    );

    /// Stops after request `request` of the run (counted from the run's first request).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn at(request: Option<usize>) -> Self {
        Self(request)
    }

    /// Whether the process stops itself after request `request`.
    pub(crate) fn is(self, request: usize) -> bool {
        #[cfg(feature = "test-hooks")]
        {
            self.0 == Some(request)
        }
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = request;
            false
        }
    }

    /// The process stops itself with SIGSTOP, at once, so that a test finds it in the middle of
    /// a request (the caller waited until what that request's call sent has left) and kills it
    /// there. Called only where [`StopAfter::is`] holds.
    pub(crate) fn stop_here(self) {
        #[cfg(feature = "test-hooks")]
        {
            eprintln!("kvhandoff node: stopping myself (SIGSTOP), as asked");
            // raise(3), not a spawned kill(1): the process must stop before its other threads
            // answer anything more (a grant sent while `kill` starts lets the read the test
            // wants cut land).
            if let Err(error) = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP) {
                eprintln!("kvhandoff node: could not stop myself: {error}");
            }
        }
    }
}

/// TEST HOOK of the repeated-handshake test: the thread that sends the peer this rank's
/// handshake again ([`Repeater::start`]). Without the feature `test-hooks`: none.
pub(crate) struct Repeater(Option<JoinHandle<Result<(), String>>>);

impl Repeater {
    /// None: the handshake is not repeated.
    pub(crate) const NONE: Self = Self(None);

    /// At `at`, sends `peer` this rank's handshake again: a second dial through the link, and a
    /// raw copy of the frame from a plain socket (whose answer is read and dropped). Both
    /// repeat the live incarnation.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn start(
        link: actix::Recipient<Connect>,
        own: PeerInfo,
        to: PeerAddr,
        addr: std::net::SocketAddr,
        at: Instant,
    ) -> Self {
        use std::io::{Read, Write};
        use std::net::TcpStream;
        use std::time::Duration;

        use kvhandoff_protocol::{wire, Message, TransferMode};

        Self(Some(std::thread::spawn(move || {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
            link.do_send(Connect(to));
            let frame = wire::encode(&Message::Handshake(Box::new(own.handshake(
                vec![TransferMode::Push],
                0,
                kvhandoff_protocol::TraceId::random(),
            ))));
            let io = |e: std::io::Error| format!("the raw handshake copy to {addr}: {e}");
            let limit = Duration::from_secs(5);
            let mut stream = TcpStream::connect_timeout(&addr, limit).map_err(io)?;
            stream.set_read_timeout(Some(limit)).map_err(io)?;
            stream.set_write_timeout(Some(limit)).map_err(io)?;
            stream.write_all(&frame).map_err(io)?;
            let mut answer = Vec::new();
            stream.read_to_end(&mut answer).map_err(io)?;
            match wire::decode(&answer) {
                Ok(Message::Handshake(_)) => {
                    eprintln!("kvhandoff node: repeated the handshake (second dial, raw copy)");
                    Ok(())
                }
                other => Err(format!(
                    "the raw handshake copy to {addr} was not answered with a handshake: \
                     {other:?}"
                )),
            }
        })))
    }

    /// Waits for the repeater's thread; what went wrong there goes to `errors`.
    pub(crate) fn join(self, errors: &mut Vec<String>) {
        let Some(thread) = self.0 else { return };
        match thread.join() {
            Ok(Ok(())) => {}
            Ok(Err(why)) => errors.push(why),
            Err(_) => errors.push("the handshake repeater panicked".into()),
        }
    }
}
