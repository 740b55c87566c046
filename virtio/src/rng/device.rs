//! [`Rng`]: the virtio entropy [`VirtioDevice`].

use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::QueueT;

use super::handler::RngHandler;
use super::source::Backend;
use super::{RngConfig, RngError, DEVICE_NAME, QUEUE_MAX_SIZE, THREAD_NAME};
use crate::device::{
    ActivateError, Activation, DeviceState, DeviceStateError, QueuePosition, VirtioDevice,
};
use crate::rate_limiter::{RateLimiterConfig, RateLimiterState, RateLimiterStateError};
use crate::worker::{ChangeError, DeviceWorker, Held};
use gpuvm_devices::Persist;

/// The device's own snapshot state: the limits in force (a PATCH may have changed them)
/// and where their buckets stood.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngState {
    pub rate_limiter: RateLimiterConfig,
    /// The buckets at the pause (absent in version-1 state files: they start full).
    #[serde(default)]
    pub buckets: RateLimiterState,
}

/// Why the entropy device's state was refused.
#[derive(Debug, thiserror::Error)]
pub enum RngStateError {
    #[error("{DEVICE_NAME}: the saved rate limits: {0}")]
    Limits(#[source] RngError),
    #[error("{DEVICE_NAME}: {0}")]
    Buckets(#[source] RateLimiterStateError),
}

/// The virtio entropy device.
pub struct Rng {
    config: RngConfig,
    /// The source and limiter wait as its idle resources; if a worker thread panicked with
    /// them, the next activation opens the source again.
    worker: DeviceWorker<Backend, RngHandler>,
    /// The limiter's buckets as the last pause found them (what a snapshot saves).
    buckets_at_pause: RateLimiterState,
}

impl Rng {
    /// Opens the source (refusing directories, FIFOs, sockets and what cannot be read) and
    /// makes the rate limiter.
    pub fn new(config: RngConfig) -> Result<Rng, RngError> {
        let backend = Backend::new(&config)?;
        Ok(Rng {
            config,
            worker: DeviceWorker::new(DEVICE_NAME, THREAD_NAME, backend),
            buckets_at_pause: RateLimiterState::default(),
        })
    }

    /// The configuration, with the rate limits in force.
    pub fn config(&self) -> &RngConfig {
        &self.config
    }

    /// Changes the rate limits; a running device's worker is stopped after its current
    /// request, given the new limits and started again.
    pub fn update_rate_limiter(&mut self, limits: RateLimiterConfig) -> Result<(), RngError> {
        limits.validate()?;
        let updated = self.worker.change(|held| match held {
            Held::Idle(backend) => backend.limiter.update(limits),
            Held::Handler(handler) => handler.backend.limiter.update(limits),
        });
        match updated {
            Ok(result) => result?,
            // The backend is gone with its thread: the next activation makes a limiter
            // from the configuration.
            Err(ChangeError::Failed) => {}
            Err(ChangeError::Restart(error)) => return Err(RngError::Thread(error)),
        }
        self.config.rate_limiter = limits;
        Ok(())
    }
}

impl VirtioDevice for Rng {
    fn name(&self) -> &str {
        DEVICE_NAME
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_MAX_SIZE]
    }

    fn device_features(&self) -> u64 {
        (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << VIRTIO_RING_F_INDIRECT_DESC)
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // virtio-rng has no configuration space.
        crate::read_config_bytes(&[], offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "{DEVICE_NAME}: ignoring a {}-byte write at {offset:#x} of its (empty) configuration space",
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        // A second activation without a reset: start over from the first's backend.
        self.reset();
        let given = activation.queues.iter().filter(|q| q.is_some()).count();
        let Some(Some(active)) = activation.queues.into_iter().next() else {
            return Err(ActivateError::QueueCount {
                device: DEVICE_NAME,
                given,
                needed: 1,
            });
        };
        let backend = match self.worker.take_idle() {
            Ok(backend) => backend,
            // Lost with a worker thread that panicked.
            Err(_) => Backend::new(&self.config).map_err(|error| ActivateError::Device {
                device: DEVICE_NAME,
                message: error.to_string(),
            })?,
        };
        let mut queue = active.queue;
        queue.set_event_idx(activation.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        let handler = RngHandler::new(
            backend,
            queue,
            active.kick,
            activation.memory,
            activation.interrupt,
        );
        self.worker
            .start(handler)
            .map_err(|error| ActivateError::thread(DEVICE_NAME, error))
    }

    fn reset(&mut self) {
        self.worker.reset(|handler| handler.backend);
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        let was_running = self.worker.is_running();
        let positions = match self.worker.pause() {
            Some(handler) => vec![Some(handler.position())],
            // Its I/O thread panicked: the queue's position is lost.
            None if was_running => vec![None],
            None => Vec::new(),
        };
        // Paused or idle: read directly, no thread is stopped. A failed device's limiter
        // is gone with its thread: its buckets restore full.
        self.buckets_at_pause = self
            .worker
            .change(|held| match held {
                Held::Idle(backend) => backend.limiter.save(),
                Held::Handler(handler) => handler.backend.limiter.save(),
            })
            .ok()
            .and_then(Result::ok)
            .unwrap_or_default();
        positions
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.worker
            .resume()
            .map_err(|error| ActivateError::thread(DEVICE_NAME, error))
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::Rng(Persist::save(self)?))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::Rng(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(DEVICE_NAME, "rng", other)),
        }
    }
}

impl Persist for Rng {
    type State = RngState;
    type Error = RngStateError;

    /// The limits in force and their buckets as the last pause found them.
    fn save(&self) -> Result<RngState, RngStateError> {
        Ok(RngState {
            rate_limiter: self.config.rate_limiter,
            buckets: self.buckets_at_pause,
        })
    }

    /// Takes the saved limits (if a PATCH had changed them) and their buckets; all is
    /// checked before anything changes.
    fn restore(&mut self, state: &RngState) -> Result<(), RngStateError> {
        state
            .rate_limiter
            .validate()
            .map_err(|error| RngStateError::Limits(error.into()))?;
        state.buckets.check().map_err(RngStateError::Buckets)?;
        if state.rate_limiter != self.config.rate_limiter {
            self.update_rate_limiter(state.rate_limiter)
                .map_err(RngStateError::Limits)?;
        }
        let buckets = state.buckets;
        let loaded = self.worker.change(|held| match held {
            Held::Idle(backend) => backend.limiter.restore(&buckets),
            Held::Handler(handler) => handler.backend.limiter.restore(&buckets),
        });
        match loaded {
            Ok(result) => result.map_err(RngStateError::Buckets),
            // Gone with a thread that panicked: the next activation starts full.
            Err(ChangeError::Failed) => Ok(()),
            Err(ChangeError::Restart(error)) => Err(RngStateError::Limits(RngError::Thread(error))),
        }
    }
}
