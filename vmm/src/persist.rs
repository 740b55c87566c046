//! The snapshot state file's framing, and the errors of saving and restoring state. What
//! the file holds is the snapshot's [`crate::snapshot::MachineState`], a tree of the
//! components' own states (each [`gpuvm_devices::Persist`] implementation's `State`).
//!
//! State file layout (all integers little-endian):
//! ```text
//! offset 0   8 bytes  magic "GPUVMSTA"
//! offset 8   u32      format version (STATE_FORMAT_VERSION; older ones from
//!                     OLDEST_STATE_FORMAT_VERSION on are migrated as they are read)
//! offset 12  u32      CRC32 (IEEE) of the payload
//! offset 16  u64      payload length in bytes
//! offset 24  payload  JSON-encoded MachineState
//! ```
//! Guest memory is not in this file; `MachineState::memory` names the memory files.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The memory crate's magic for gpuvm's framed files, by which a snapshot directory's
/// cleanup knows a `state` or `working-set` as gpuvm's own.
pub const STATE_MAGIC: &[u8; 8] = gpuvm_memory::snapshot::FRAMED_FILE_MAGIC;
/// The version this gpuvm writes. Version 2 typed each virtio device's own state (see
/// [`crate::snapshot::migrate`]).
pub const STATE_FORMAT_VERSION: u32 = 2;
/// The oldest version this gpuvm reads, rewriting it into the current one as it loads.
pub const OLDEST_STATE_FORMAT_VERSION: u32 = 1;
const HEADER_LEN: usize = 24;
/// A state file is small (tens of KiB per vCPU); anything near this is not one of ours.
const MAX_PAYLOAD: u64 = 64 << 20;
/// The largest state file read: larger ones are refused unread.
pub const MAX_STATE_FILE: u64 = HEADER_LEN as u64 + MAX_PAYLOAD;

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("failed to {what} of vCPU {id}: {source}")]
    Vcpu {
        id: u8,
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("failed to {what} of the VM: {source}")]
    Vm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM refused MSR {index:#x} of vCPU {id} on restore")]
    MsrRestore { id: u8, index: u32 },
    #[error("cannot read state file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot write state file {path}: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
    #[error("{path} is not a gpuvm state file (bad magic)")]
    BadMagic { path: String },
    #[error(
        "{path} has state format version {found}; this gpuvm reads versions {OLDEST_STATE_FORMAT_VERSION} to {STATE_FORMAT_VERSION}"
    )]
    UnknownVersion { path: String, found: u32 },
    #[error("{path} has state format version {version}, which cannot be brought to version {STATE_FORMAT_VERSION}: {source}")]
    Migrate {
        path: String,
        version: u32,
        source: crate::snapshot::migrate::MigrationError,
    },
    #[error("{path} is truncated or has trailing data: header says {expected} payload bytes, file has {actual}")]
    BadLength {
        path: String,
        expected: u64,
        actual: u64,
    },
    #[error("{path} is corrupt: CRC mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    BadCrc {
        path: String,
        stored: u32,
        computed: u32,
    },
    #[error("{path} is corrupt: {source}")]
    Decode {
        path: String,
        source: serde_json::Error,
    },
    #[error("cannot encode the machine state: {0}")]
    Encode(serde_json::Error),
}

/// Frames `state` and writes it atomically (temporary file, fsync, rename, fsync dir), with
/// the same helper the memory files use.
pub fn write_state_file<T: Serialize>(path: &Path, state: &T) -> Result<(), PersistError> {
    let payload = serde_json::to_vec(state).map_err(PersistError::Encode)?;
    // Never write a file that reading would refuse.
    if payload.len() as u64 > MAX_PAYLOAD {
        return Err(PersistError::Write {
            path: path.display().to_string(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "the state is {} bytes, more than the {MAX_PAYLOAD} a state file may hold",
                    payload.len()
                ),
            ),
        });
    }
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
    bytes.extend_from_slice(STATE_MAGIC);
    bytes.extend_from_slice(&STATE_FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&payload);
    gpuvm_memory::snapshot::write_atomically(path, |file| {
        use std::io::Write;
        file.write_all(&bytes)
    })
    .map_err(|source| PersistError::Write {
        path: path.display().to_string(),
        source,
    })
}

/// Reads and validates a state file: a regular file of at most [`MAX_STATE_FILE`] bytes
/// (a FIFO, a device or a huge file is refused before it is read), then magic, version,
/// length, CRC, and decodes it.
pub fn read_state_file<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, PersistError> {
    let name = path.display().to_string();
    let bytes =
        gpuvm_memory::snapshot::read_regular_file(path, MAX_STATE_FILE).map_err(|source| {
            PersistError::Read {
                path: name.clone(),
                source,
            }
        })?;
    decode_state(&bytes, &name)
}

/// As [`read_state_file`], for the file `name` of the snapshot directory `dir`, opened the
/// one way a snapshot's files are (`gpuvm_memory::snapshot::open_in_dir`: inside `dir`,
/// no symbolic link followed).
pub fn read_state_file_in_dir<T: for<'de> Deserialize<'de>>(
    dir: &Path,
    name: &str,
) -> Result<T, PersistError> {
    let shown = dir.join(name).display().to_string();
    let bytes =
        gpuvm_memory::snapshot::read_in_dir(dir, name, MAX_STATE_FILE).map_err(|source| {
            PersistError::Read {
                path: shown.clone(),
                source,
            }
        })?;
    decode_state(&bytes, &shown)
}

/// As [`read_state_file`], for a state file's bytes already read (`name` says where they
/// came from in errors).
pub fn decode_state_bytes<T: for<'de> Deserialize<'de>>(
    bytes: &[u8],
    name: &str,
) -> Result<T, PersistError> {
    decode_state(bytes, name)
}

fn decode_state<T: for<'de> Deserialize<'de>>(bytes: &[u8], name: &str) -> Result<T, PersistError> {
    if bytes.len() < HEADER_LEN || &bytes[..8] != STATE_MAGIC {
        return Err(PersistError::BadMagic { path: name.into() });
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let version = word(8);
    if !(OLDEST_STATE_FORMAT_VERSION..=STATE_FORMAT_VERSION).contains(&version) {
        return Err(PersistError::UnknownVersion {
            path: name.into(),
            found: version,
        });
    }
    let stored_crc = word(12);
    let mut len_bytes = [0u8; 8];
    len_bytes.copy_from_slice(&bytes[16..24]);
    let expected = u64::from_le_bytes(len_bytes);
    let actual = (bytes.len() - HEADER_LEN) as u64;
    if expected != actual || expected > MAX_PAYLOAD {
        return Err(PersistError::BadLength {
            path: name.into(),
            expected,
            actual,
        });
    }
    let payload = &bytes[HEADER_LEN..];
    let computed = crc32fast::hash(payload);
    if computed != stored_crc {
        return Err(PersistError::BadCrc {
            path: name.into(),
            stored: stored_crc,
            computed,
        });
    }
    let decode_error = |source| PersistError::Decode {
        path: name.into(),
        source,
    };
    if version == STATE_FORMAT_VERSION {
        return serde_json::from_slice(payload).map_err(decode_error);
    }
    // An older format: rewritten step by step, then read as the current one.
    let mut value: serde_json::Value = serde_json::from_slice(payload).map_err(decode_error)?;
    for from in version..STATE_FORMAT_VERSION {
        value = crate::snapshot::migrate::step(from, value).map_err(|source| {
            PersistError::Migrate {
                path: name.into(),
                version,
                source,
            }
        })?;
    }
    serde_json::from_value(value).map_err(decode_error)
}

/// Exact-size decoding of KVM's structures in a state file. kvm-bindings writes each as
/// its bytes (a JSON array of numbers) and, reading, zero-fills a list that is short and
/// drops what a long one has beyond the structure: a forged or damaged list would load
/// as registers nobody saved. These take the list, require exactly the structure's size,
/// and only then hand the bytes to kvm-bindings. For `#[serde(deserialize_with)]`.
pub(crate) mod exact_bytes {
    use serde::de::{Deserialize, Deserializer, Error};

    fn short_name<T>() -> &'static str {
        let name = std::any::type_name::<T>();
        name.rsplit("::").next().unwrap_or(name)
    }

    fn from_bytes<'de, T: Deserialize<'de>, E: Error>(bytes: &[u8]) -> Result<T, E> {
        let size = std::mem::size_of::<T>();
        if bytes.len() != size {
            return Err(E::custom(format!(
                "a {} of {} bytes, where it has {size}: the state is damaged or forged",
                short_name::<T>(),
                bytes.len()
            )));
        }
        T::deserialize(serde::de::value::BytesDeserializer::<E>::new(bytes))
    }

    /// One structure.
    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<T, D::Error> {
        let bytes = Vec::<u8>::deserialize(deserializer)?;
        from_bytes(&bytes)
    }

    /// A list of structures.
    pub fn vec<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<Vec<T>, D::Error> {
        let lists = Vec::<Vec<u8>>::deserialize(deserializer)?;
        lists.iter().map(|bytes| from_bytes(bytes)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_regs;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Sample {
        name: String,
        #[serde(deserialize_with = "exact_bytes::deserialize")]
        regs: kvm_regs,
    }

    /// Issue 31: a KVM structure one byte short, or one byte long, is refused naming it,
    /// not zero-filled or cut.
    #[test]
    fn kvm_structures_of_the_wrong_size_are_refused() {
        let mut value = serde_json::to_value(sample()).unwrap();
        let bytes = value["regs"].as_array().unwrap().clone();
        assert_eq!(bytes.len(), std::mem::size_of::<kvm_regs>());
        let back: Sample = serde_json::from_value(value.clone()).unwrap();
        assert_eq!(back, sample());
        value["regs"] = serde_json::Value::Array(bytes[..bytes.len() - 1].to_vec());
        let error = serde_json::from_value::<Sample>(value.clone()).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("a kvm_regs of 143 bytes, where it has 144"),
            "{error}"
        );
        let mut long = bytes.clone();
        long.push(0.into());
        value["regs"] = serde_json::Value::Array(long);
        assert!(serde_json::from_value::<Sample>(value).is_err());
    }

    fn sample() -> Sample {
        Sample {
            name: "vm".into(),
            regs: kvm_regs {
                rip: 0x1234,
                rax: 42,
                ..Default::default()
            },
        }
    }

    /// A scratch directory for one test's state file, removed when the test ends (a
    /// 64 MiB one among them: left behind, every run of the suite would add its files).
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn state(&self) -> std::path::PathBuf {
            self.0.join("state")
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn temp(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("gpuvm-persist-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    #[test]
    fn round_trip() {
        let scratch = temp("round-trip");
        let path = scratch.state();
        write_state_file(&path, &sample()).unwrap();
        let back: Sample = read_state_file(&path).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn every_corruption_is_detected() {
        let scratch = temp("corrupt");
        let path = scratch.state();
        write_state_file(&path, &sample()).unwrap();
        let good = std::fs::read(&path).unwrap();
        let check = |bytes: &[u8]| decode_state::<Sample>(bytes, "state").unwrap_err();

        assert!(matches!(check(&good[..10]), PersistError::BadMagic { .. }));
        let mut bad = good.clone();
        bad[0] ^= 0xff;
        assert!(matches!(check(&bad), PersistError::BadMagic { .. }));
        let mut bad = good.clone();
        bad[8] = 99;
        assert!(matches!(
            check(&bad),
            PersistError::UnknownVersion { found: 99, .. }
        ));
        assert!(matches!(
            check(&good[..good.len() - 1]),
            PersistError::BadLength { .. }
        ));
        let mut longer = good.clone();
        longer.push(0);
        assert!(matches!(check(&longer), PersistError::BadLength { .. }));
        // Flip one bit in every payload byte position in turn: the CRC catches each.
        for at in [HEADER_LEN, HEADER_LEN + 7, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 1;
            assert!(
                matches!(check(&bad), PersistError::BadCrc { .. }),
                "byte {at}"
            );
        }
    }

    /// Issue 25: version-1 files are read through the migration; versions outside 1..=2
    /// are refused, and a version-1 payload the migration cannot rewrite names why.
    #[test]
    fn older_versions_are_migrated_and_unknown_ones_refused() {
        let scratch = temp("versions");
        let path = scratch.state();
        write_state_file(&path, &sample()).unwrap();
        let good = std::fs::read(&path).unwrap();
        assert_eq!(good[8..12], STATE_FORMAT_VERSION.to_le_bytes());
        let with_version = |bytes: &[u8], version: u32| {
            let mut bytes = bytes.to_vec();
            bytes[8..12].copy_from_slice(&version.to_le_bytes());
            bytes
        };
        // A payload without virtio devices reads the same in either version.
        let back: Sample = decode_state(&with_version(&good, 1), "state").unwrap();
        assert_eq!(back, sample());
        for version in [0, STATE_FORMAT_VERSION + 1] {
            assert!(matches!(
                decode_state::<Sample>(&with_version(&good, version), "state").unwrap_err(),
                PersistError::UnknownVersion { found, .. } if found == version
            ));
        }
        let framed = |payload: &serde_json::Value, version: u32| {
            let payload = serde_json::to_vec(payload).unwrap();
            let mut bytes = STATE_MAGIC.to_vec();
            bytes.extend_from_slice(&version.to_le_bytes());
            bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
            bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
            bytes.extend_from_slice(&payload);
            bytes
        };
        let damaged = serde_json::json!({"virtio": [{"config": {"gpu": {}}, "transport": {}}]});
        let error = decode_state::<serde_json::Value>(&framed(&damaged, 1), "state").unwrap_err();
        assert!(
            matches!(error, PersistError::Migrate { version: 1, .. })
                && error.to_string().contains("no known kind (gpu)"),
            "{error}"
        );
        // The same payload as version 2 is not migrated: it is read as it is.
        let read: serde_json::Value = decode_state(&framed(&damaged, 2), "state").unwrap();
        assert_eq!(read, damaged);
    }

    #[test]
    fn only_regular_state_files_of_bounded_size_are_read() {
        let scratch = temp("special");
        let path = scratch.state();
        let _ = std::fs::remove_file(&path);
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let error = read_state_file::<Sample>(&path).unwrap_err();
        assert!(
            matches!(&error, PersistError::Read { .. })
                && error.to_string().contains("not a regular file"),
            "{error}"
        );
        std::fs::remove_file(&path).unwrap();
        // Larger than any state: refused by its size, unread.
        let file = std::fs::File::create(&path).unwrap();
        file.set_len(MAX_STATE_FILE + 1).unwrap();
        let error = read_state_file::<Sample>(&path).unwrap_err();
        assert!(error.to_string().contains("too large"), "{error}");
    }

    #[test]
    fn state_write_replaces_whole_file() {
        let scratch = temp("atomic");
        let path = scratch.state();
        write_state_file(&path, &sample()).unwrap();
        let second = Sample {
            name: "second version".into(),
            ..sample()
        };
        write_state_file(&path, &second).unwrap();
        let back: Sample = read_state_file(&path).unwrap();
        assert_eq!(back, second);
        let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty());
    }
}
