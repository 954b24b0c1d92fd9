//! Bearer tokens: how a caller of the control plane says who it is.
//!
//! A client sends `authorization: Bearer <token>` with every gRPC call. A control plane started
//! with a tokens file (`starckpt server --tokens-file`, `server/src/control/auth.rs`) knows each
//! token only by its hash, [`hash`], so the file holds no secret worth stealing; a token is
//! [`generate`]d once (`starckpt token new`) and shown once.
//!
//! A token is `stk_` and 64 hex digits: 256 random bits, so no guess or precomputed table finds
//! one, and the hash needs no salt; the prefix lets secret scanners recognise a leaked one.

/// The gRPC metadata key the token travels in.
pub const AUTHORIZATION: &str = "authorization";
/// What precedes the token in [`AUTHORIZATION`]'s value.
pub const BEARER: &str = "Bearer ";
/// What every token starts with.
pub const PREFIX: &str = "stk_";
/// BLAKE3 derive-key context of [`hash`]: a token's hash is of no use as anything else's.
const HASH_CONTEXT: &str = "starckpt 2026-12-02 bearer token hash";

/// A new token from the operating system's random source.
pub fn generate() -> String {
    use rand::RngCore;
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    format!("{PREFIX}{}", hex::encode(secret))
}

/// What a tokens file records of `token`.
pub fn hash(token: &str) -> [u8; 32] {
    let mut hasher = blake3::Hasher::new_derive_key(HASH_CONTEXT);
    hasher.update(token.as_bytes());
    *hasher.finalize().as_bytes()
}

/// Checks that `token` can travel in a gRPC header and looks like one [`generate`] made (what an
/// operator pasted with a stray quote, or a file with two lines, is refused before any call).
pub fn check(token: &str) -> Result<(), String> {
    let Some(digits) = token.strip_prefix(PREFIX) else {
        return Err(format!("a bearer token starts with {PREFIX:?} (`starckpt token new` makes one)"));
    };
    if digits.len() != 64 || !digits.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("a bearer token is {PREFIX:?} and 64 hex digits"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_check_and_hash_apart() {
        let (first, second) = (generate(), generate());
        assert_ne!(first, second);
        check(&first).unwrap();
        assert_ne!(hash(&first), hash(&second));
        assert_eq!(hash(&first), hash(&first.clone()));
        for bad in ["", "stk_", "abc", &format!("{first}\n"), &first[..first.len() - 1], &format!("x{first}")] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
    }
}
