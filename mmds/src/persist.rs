//! What a live update carries of a VM's MMDS ([`MmdsState`]): the configuration, the data
//! store with its limit, and the live V2 tokens with the time each has left (an `Instant`
//! means nothing in another process). A guest that holds a token keeps using it under the
//! new process. Connections to the TCP responder are not carried: a request in flight when
//! the VM changes hands is reset, and the guest's client asks again.

use serde::{Deserialize, Serialize};

use crate::token::{MAX_TOKENS, MAX_TTL_SECONDS, TOKEN_LEN};
use crate::{DataStoreError, Mmds, MmdsConfig};

/// One VM's MMDS as it is handed over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmdsState {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<MmdsConfig>,
    /// The data store (a JSON object).
    pub data: serde_json::Value,
    /// The data store's limit in bytes of serialized JSON.
    pub limit: usize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<SavedToken>,
}

/// A live V2 token and how long it has left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedToken {
    pub token: String,
    pub remaining_ms: u64,
}

/// Why a handed-over MMDS state was refused (the MMDS is left as it was).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MmdsStateError {
    #[error("the MMDS configuration: {0}")]
    Config(#[from] crate::ConfigError),
    #[error("the MMDS data store: {0}")]
    Store(#[from] DataStoreError),
    #[error("{0} MMDS tokens, more than the {MAX_TOKENS} kept")]
    TooManyTokens(usize),
    #[error("an MMDS token that is not {TOKEN_LEN} hex digits")]
    MalformedToken,
    #[error("an MMDS token with {0} ms left, more than a token ever lives")]
    TokenLifetime(u64),
}

impl Mmds {
    /// This MMDS's state, or `None` when it is as a new VM's (nothing configured, stored
    /// or given out), so that a hand-over without MMDS reads as before.
    pub fn save(&self) -> Option<MmdsState> {
        let config = self.config();
        let (data, limit) = {
            let store = self.store();
            (store.data().clone(), store.limit())
        };
        let tokens: Vec<SavedToken> = self
            .tokens()
            .live()
            .map(|(token, remaining)| SavedToken {
                token: token.to_string(),
                remaining_ms: remaining.as_millis() as u64,
            })
            .collect();
        let pristine = config.is_none()
            && data.as_object().is_some_and(|map| map.is_empty())
            && limit == crate::DEFAULT_SIZE_LIMIT
            && tokens.is_empty();
        (!pristine).then_some(MmdsState {
            config,
            data,
            limit,
            tokens,
        })
    }

    /// Takes `state` over, all of it or (on an error) none of it.
    pub fn restore(&self, state: &MmdsState) -> Result<(), MmdsStateError> {
        if let Some(config) = &state.config {
            config.validate()?;
        }
        let mut store = crate::DataStore::with_limit(state.limit);
        store.put(state.data.clone())?;
        if state.tokens.len() > MAX_TOKENS {
            return Err(MmdsStateError::TooManyTokens(state.tokens.len()));
        }
        let mut tokens = crate::TokenAuthority::default();
        for saved in &state.tokens {
            let hex = saved.token.bytes().all(|b| b.is_ascii_hexdigit());
            if saved.token.len() != TOKEN_LEN || !hex {
                return Err(MmdsStateError::MalformedToken);
            }
            if saved.remaining_ms > MAX_TTL_SECONDS * 1000 {
                return Err(MmdsStateError::TokenLifetime(saved.remaining_ms));
            }
            tokens.adopt(
                saved.token.clone(),
                std::time::Duration::from_millis(saved.remaining_ms),
            );
        }
        self.set_config(state.config.clone());
        *self.store() = store;
        *self.tokens() = tokens;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MmdsConfig, MmdsVersion};

    fn configured() -> Mmds {
        let mmds = Mmds::default();
        mmds.set_config(Some(MmdsConfig::new(MmdsVersion::V2, vec!["eth0".into()])));
        mmds.store().set_limit(4096);
        mmds.store()
            .put(serde_json::json!({"latest": {"meta-data": {"instance-id": "i-1"}}}))
            .unwrap();
        mmds
    }

    #[test]
    fn a_new_mmds_has_nothing_to_hand_over() {
        assert_eq!(Mmds::default().save(), None);
    }

    #[test]
    fn configuration_store_limit_and_live_tokens_go_over_and_tokens_keep_their_expiry() {
        let old = configured();
        let token = old.tokens().generate(60).unwrap();
        let state = old.save().expect("a configured MMDS is saved");
        assert_eq!(state.tokens.len(), 1);
        assert!((59_000..=60_000).contains(&state.tokens[0].remaining_ms));
        // Through its serialized form, as the hand-over sends it.
        let state: MmdsState =
            serde_json::from_slice(&serde_json::to_vec(&state).unwrap()).unwrap();
        let new = Mmds::default();
        new.restore(&state).unwrap();
        assert_eq!(new.config(), old.config());
        assert_eq!(new.store().data(), old.store().data());
        assert_eq!(new.store().limit(), 4096);
        assert!(new.tokens().is_valid(&token));
        assert!(!new.tokens().is_valid(&"0".repeat(TOKEN_LEN)));
        // The limit came with the store: a larger store is still refused.
        let big = serde_json::json!({"x": "y".repeat(5000)});
        assert!(matches!(
            new.store().put(big),
            Err(DataStoreError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_token_past_its_time_is_not_carried_nor_valid_after() {
        let old = configured();
        let state = MmdsState {
            tokens: vec![SavedToken {
                token: "a".repeat(TOKEN_LEN),
                remaining_ms: 0,
            }],
            ..old.save().unwrap()
        };
        let new = Mmds::default();
        new.restore(&state).unwrap();
        assert!(!new.tokens().is_valid(&"a".repeat(TOKEN_LEN)));
        assert!(new.save().unwrap().tokens.is_empty());
    }

    #[test]
    fn a_damaged_state_is_refused_and_leaves_the_mmds_as_it_was() {
        let good = configured().save().unwrap();
        let cases = [
            MmdsState {
                data: serde_json::json!([1, 2]),
                ..good.clone()
            },
            MmdsState {
                limit: 10,
                ..good.clone()
            },
            MmdsState {
                tokens: vec![SavedToken {
                    token: "zz".repeat(TOKEN_LEN / 2),
                    remaining_ms: 1000,
                }],
                ..good.clone()
            },
            MmdsState {
                tokens: vec![SavedToken {
                    token: "a".repeat(TOKEN_LEN),
                    remaining_ms: MAX_TTL_SECONDS * 1000 + 1,
                }],
                ..good.clone()
            },
            MmdsState {
                tokens: (0..MAX_TOKENS + 1)
                    .map(|_| SavedToken {
                        token: "b".repeat(TOKEN_LEN),
                        remaining_ms: 1000,
                    })
                    .collect(),
                ..good.clone()
            },
            MmdsState {
                config: Some(MmdsConfig::new(MmdsVersion::V1, Vec::new())),
                ..good.clone()
            },
        ];
        for case in cases {
            let mmds = Mmds::default();
            assert!(mmds.restore(&case).is_err(), "{case:?}");
            assert_eq!(mmds.save(), None, "{case:?} changed the MMDS");
        }
    }
}
