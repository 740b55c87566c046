//! The JSON data store: PUT replaces it, PATCH merges into it (RFC 7396), GET reads it;
//! bounded by a size limit on its serialized form (Firecracker's default 51200 bytes).

use serde_json::{Map, Value};

/// Firecracker's default data store limit, in bytes of serialized JSON.
pub const DEFAULT_SIZE_LIMIT: usize = 51200;

/// Why a data store change was refused (the store is unchanged).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DataStoreError {
    #[error("the MMDS data store must be a JSON object")]
    NotAnObject,
    #[error("the MMDS data store would be {size} bytes, over its limit of {limit} bytes")]
    TooLarge { size: usize, limit: usize },
}

/// Why a GET path did not resolve.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LookupError {
    #[error("resource not found: {0}")]
    NotFound(String),
    #[error("the value at {0} cannot be given as text (only strings and objects can)")]
    NotText(String),
}

/// The metadata guests read.
#[derive(Debug)]
pub struct DataStore {
    data: Value,
    limit: usize,
}

impl Default for DataStore {
    fn default() -> Self {
        DataStore::with_limit(DEFAULT_SIZE_LIMIT)
    }
}

fn size_of(value: &Value) -> usize {
    serde_json::to_vec(value)
        .map(|v| v.len())
        .unwrap_or(usize::MAX)
}

fn merge(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(target) = target {
        for (key, value) in patch {
            if value.is_null() {
                target.remove(key);
            } else {
                merge(target.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

impl DataStore {
    pub fn with_limit(limit: usize) -> Self {
        DataStore {
            data: Value::Object(Map::new()),
            limit,
        }
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Sets the limit for later changes (`--mmds-size-limit`, given before any data).
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    pub fn data(&self) -> &Value {
        &self.data
    }

    fn check(&self, value: &Value) -> Result<(), DataStoreError> {
        if !value.is_object() {
            return Err(DataStoreError::NotAnObject);
        }
        let size = size_of(value);
        if size > self.limit {
            return Err(DataStoreError::TooLarge {
                size,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// PUT: the whole store replaced.
    pub fn put(&mut self, value: Value) -> Result<(), DataStoreError> {
        self.check(&value)?;
        self.data = value;
        Ok(())
    }

    /// PATCH: a JSON merge patch (null removes a key).
    pub fn patch(&mut self, patch: &Value) -> Result<(), DataStoreError> {
        if !patch.is_object() {
            return Err(DataStoreError::NotAnObject);
        }
        let mut merged = self.data.clone();
        merge(&mut merged, patch);
        self.check(&merged)?;
        self.data = merged;
        Ok(())
    }

    /// The value at a URI path such as `/latest/meta-data/ami-id` (empty segments are
    /// skipped; `/` is the whole store).
    pub fn lookup(&self, path: &str) -> Result<&Value, LookupError> {
        let mut at = &self.data;
        for segment in path.split('/').filter(|s| !s.is_empty()) {
            at = match at {
                Value::Object(map) => map.get(segment),
                Value::Array(items) => segment.parse::<usize>().ok().and_then(|i| items.get(i)),
                _ => None,
            }
            .ok_or_else(|| LookupError::NotFound(path.to_string()))?;
        }
        Ok(at)
    }

    /// What a GET without `Accept: application/json` returns, as Firecracker's MMDS
    /// does: an object's keys one per line (objects with a trailing '/'), a string's value.
    pub fn lookup_text(&self, path: &str) -> Result<String, LookupError> {
        match self.lookup(path)? {
            Value::String(s) => Ok(s.clone()),
            Value::Object(map) => Ok(map
                .iter()
                .map(|(key, value)| {
                    if value.is_object() {
                        format!("{key}/")
                    } else {
                        key.clone()
                    }
                })
                .collect::<Vec<_>>()
                .join("\n")),
            _ => Err(LookupError::NotText(path.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn put_patch_and_lookups() {
        let mut store = DataStore::default();
        store
            .put(json!({"latest": {"meta-data": {"ami-id": "ami-1", "tags": {"a": "b"}}}, "n": 3}))
            .unwrap();
        assert_eq!(
            store.lookup_text("/latest/meta-data/").unwrap(),
            "ami-id\ntags/"
        );
        assert_eq!(
            store.lookup_text("/latest/meta-data/ami-id").unwrap(),
            "ami-1"
        );
        assert_eq!(store.lookup("/n").unwrap(), &json!(3));
        assert!(matches!(
            store.lookup_text("/n"),
            Err(LookupError::NotText(_))
        ));
        assert!(matches!(
            store.lookup("/nope"),
            Err(LookupError::NotFound(_))
        ));
        store
            .patch(&json!({"latest": {"meta-data": {"ami-id": null, "x": "y"}}}))
            .unwrap();
        assert_eq!(store.lookup_text("/latest/meta-data").unwrap(), "tags/\nx");
        assert_eq!(store.put(json!([1])), Err(DataStoreError::NotAnObject));
        assert_eq!(store.patch(&json!("x")), Err(DataStoreError::NotAnObject));
    }

    #[test]
    fn the_limit_holds_and_a_refused_change_changes_nothing() {
        let mut store = DataStore::with_limit(32);
        store.put(json!({"a": "b"})).unwrap();
        let big = json!({"a": "x".repeat(64)});
        assert!(matches!(
            store.put(big.clone()),
            Err(DataStoreError::TooLarge { .. })
        ));
        assert!(matches!(
            store.patch(&big),
            Err(DataStoreError::TooLarge { .. })
        ));
        assert_eq!(store.data(), &json!({"a": "b"}));
    }

    #[test]
    fn a_changed_limit_applies_to_the_next_change() {
        let mut store = DataStore::default();
        store.set_limit(16);
        assert_eq!(store.limit(), 16);
        assert_eq!(
            store.put(json!({"key": "0123456789"})),
            Err(DataStoreError::TooLarge {
                size: 20,
                limit: 16
            })
        );
        store.put(json!({"k": "v"})).unwrap();
        store.set_limit(64);
        store.patch(&json!({"key": "0123456789"})).unwrap();
    }
}
