//! The sending side of the action contract ([`crate::action`]): how a front end hands a
//! [`VmmAction`] to the VMM thread and waits for its answer. Every sender goes through
//! [`ActionSender`]: the API server's connections, the Cloud Hypervisor and Firecracker
//! front ends' start-up threads, and the GPU release thread.
//!
//! The receiving side is the controller ([`crate::controller::ApiController`] before the
//! VM runs, its run loop after): it takes each [`ActionRequest`] from the channel when the
//! eventfd wakes it, carries the action out and sends the answer back on the request's
//! own reply channel.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::action::{ActionError, ActionRequest, ActionResult, VmmAction};

/// The VMM thread has ended (or dropped its end of the channel): it takes no more actions,
/// and an action sent before it ended may have gone unanswered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the VMM has stopped")]
pub struct VmmGone;

impl From<VmmGone> for ActionError {
    /// What an API client is answered when the VMM thread has gone: 503.
    fn from(gone: VmmGone) -> ActionError {
        ActionError {
            status: 503,
            message: gone.to_string(),
        }
    }
}

/// A way into the VMM thread: the request channel and the eventfd that wakes its loop to
/// read it. Cloning it gives another sender into the same thread.
#[derive(Clone)]
pub struct ActionSender {
    requests: Sender<ActionRequest>,
    wake: Arc<EventFd>,
}

/// The VMM thread's end of a new channel: where the requests arrive and the eventfd that
/// says so (see [`crate::controller::ApiController::new`]).
pub struct ActionReceiver {
    pub requests: Receiver<ActionRequest>,
    pub wake: EventFd,
}

/// A new action channel: its first sender and the VMM thread's end. Fails only when no
/// eventfd can be made.
pub fn action_channel() -> std::io::Result<(ActionSender, ActionReceiver)> {
    let (requests_tx, requests) = channel();
    let wake = EventFd::new(EFD_NONBLOCK)?;
    let sender = ActionSender::new(requests_tx, wake.try_clone()?);
    Ok((sender, ActionReceiver { requests, wake }))
}

impl ActionSender {
    /// A sender over `requests`, waking the VMM thread through `wake` (a clone of the
    /// eventfd the thread's loop waits on).
    pub fn new(requests: Sender<ActionRequest>, wake: EventFd) -> ActionSender {
        ActionSender {
            requests,
            wake: Arc::new(wake),
        }
    }

    /// Sends `action` to the VMM thread, wakes it and waits for its answer. [`VmmGone`]
    /// when the thread has ended before answering.
    pub fn call(&self, action: VmmAction) -> Result<ActionResult, VmmGone> {
        let (reply, answer) = channel();
        self.requests
            .send(ActionRequest { action, reply })
            .map_err(|_| VmmGone)?;
        self.wake.write(1).map_err(|_| VmmGone)?;
        answer.recv().map_err(|_| VmmGone)
    }

    /// [`ActionSender::call`] with a VMM that has gone answered as an API client is
    /// answered then (503, see [`VmmGone`]).
    pub fn dispatch(&self, action: VmmAction) -> ActionResult {
        self.call(action)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::VmmData;

    #[test]
    fn an_action_goes_to_the_vmm_thread_and_its_answer_comes_back() {
        let (sender, end) = action_channel().unwrap();
        let vmm = std::thread::spawn(move || {
            let request = end.requests.recv().unwrap();
            // The wake-up is written right after the request is sent.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while end.wake.read().is_err() {
                assert!(std::time::Instant::now() < deadline, "no wake-up");
                std::thread::yield_now();
            }
            assert!(matches!(request.action, VmmAction::GetInstanceInfo));
            let _ = request.reply.send(Ok(VmmData::Empty));
            // Ends without answering the next one.
            let _unanswered = end.requests.recv().unwrap();
        });
        assert_eq!(
            sender.call(VmmAction::GetInstanceInfo),
            Ok(Ok(VmmData::Empty))
        );
        // The thread takes the request and ends: the caller learns it has gone.
        assert_eq!(sender.clone().call(VmmAction::Pause), Err(VmmGone));
        vmm.join().unwrap();
        // Nothing takes requests any more.
        let refused = sender.dispatch(VmmAction::Resume).unwrap_err();
        assert_eq!(
            refused,
            ActionError {
                status: 503,
                message: "the VMM has stopped".into()
            }
        );
    }
}
