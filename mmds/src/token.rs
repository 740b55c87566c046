//! MMDS V2 session tokens: `PUT /latest/api/token` with `X-metadata-token-ttl-seconds`
//! (1 to 21600) gives a random token, which GETs show in `X-metadata-token` until it
//! expires. At most [`MAX_TOKENS`] live at once (the oldest go first).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Firecracker's bounds on a token's lifetime.
pub const MIN_TTL_SECONDS: u64 = 1;
pub const MAX_TTL_SECONDS: u64 = 21600;
/// The most live tokens kept.
pub const MAX_TOKENS: usize = 1024;
/// A token's length in characters (hex of 32 random bytes).
pub const TOKEN_LEN: usize = 64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error(
        "X-metadata-token-ttl-seconds must be {MIN_TTL_SECONDS} to {MAX_TTL_SECONDS}, got {0}"
    )]
    Ttl(u64),
    #[error("no randomness for a token: {0}")]
    Random(String),
}

/// The live tokens.
#[derive(Debug, Default)]
pub struct TokenAuthority {
    tokens: VecDeque<(String, Instant)>,
}

fn random_hex() -> Result<String, TokenError> {
    let mut bytes = [0u8; TOKEN_LEN / 2];
    let mut filled = 0;
    while filled < bytes.len() {
        // SAFETY: getrandom writes at most `len - filled` bytes into the rest of `bytes`,
        // a buffer this function owns.
        let got = unsafe {
            libc::getrandom(bytes[filled..].as_mut_ptr().cast(), bytes.len() - filled, 0)
        };
        if got < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(TokenError::Random(error.to_string()));
        }
        filled += got as usize;
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl TokenAuthority {
    /// A new token living `ttl_seconds`.
    pub fn generate(&mut self, ttl_seconds: u64) -> Result<String, TokenError> {
        if !(MIN_TTL_SECONDS..=MAX_TTL_SECONDS).contains(&ttl_seconds) {
            return Err(TokenError::Ttl(ttl_seconds));
        }
        let token = random_hex()?;
        self.insert(token.clone(), Duration::from_secs(ttl_seconds));
        Ok(token)
    }

    /// Keeps `token` for `remaining`, after the expired ones and, past [`MAX_TOKENS`], the
    /// oldest are dropped.
    fn insert(&mut self, token: String, remaining: Duration) {
        self.expire(Instant::now());
        while self.tokens.len() >= MAX_TOKENS {
            self.tokens.pop_front();
        }
        self.tokens.push_back((token, Instant::now() + remaining));
    }

    fn expire(&mut self, now: Instant) {
        self.tokens.retain(|(_, until)| *until > now);
    }

    /// Whether `token` was given and has not expired.
    pub fn is_valid(&self, token: &str) -> bool {
        let now = Instant::now();
        token.len() == TOKEN_LEN
            && self
                .tokens
                .iter()
                .any(|(t, until)| t == token && *until > now)
    }

    /// The live tokens and the time each has left.
    pub fn live(&self) -> impl Iterator<Item = (&str, Duration)> + '_ {
        let now = Instant::now();
        self.tokens
            .iter()
            .filter(move |(_, until)| *until > now)
            .map(move |(token, until)| (token.as_str(), *until - now))
    }

    /// Takes a token given out elsewhere (by the process a live update took the VM from)
    /// with `remaining` of its life left.
    pub fn adopt(&mut self, token: String, remaining: Duration) {
        self.insert(token, remaining);
    }

    /// Test hook: the token expires now.
    #[cfg(test)]
    fn expire_all(&mut self) {
        for (_, until) in &mut self.tokens {
            *until = Instant::now() - Duration::from_millis(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_random_bounded_and_expire() {
        let mut authority = TokenAuthority::default();
        assert_eq!(authority.generate(0), Err(TokenError::Ttl(0)));
        assert_eq!(authority.generate(21601), Err(TokenError::Ttl(21601)));
        let a = authority.generate(60).unwrap();
        let b = authority.generate(60).unwrap();
        assert_ne!(a, b);
        assert_eq!(a.len(), TOKEN_LEN);
        assert!(authority.is_valid(&a) && authority.is_valid(&b));
        assert!(!authority.is_valid("nope"));
        authority.expire_all();
        assert!(!authority.is_valid(&a));
        for _ in 0..MAX_TOKENS + 5 {
            authority.generate(60).unwrap();
        }
        assert!(authority.tokens.len() <= MAX_TOKENS);
    }
}
