//! Helpers the facade's integration tests share (each test file includes this module, and
//! uses only some of it).
#![allow(dead_code)]

/// The URL of a server-backed store or broker, or `None` (skip) when it is not configured;
/// with `IDEMQ_REQUIRE_SERVERS=1` (as `scripts/test.sh` sets) a missing URL fails instead.
pub fn server_url(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ if std::env::var("IDEMQ_REQUIRE_SERVERS").as_deref() == Ok("1") => {
            panic!("{var} is not set but IDEMQ_REQUIRE_SERVERS=1: start servers with scripts/servers.sh")
        }
        _ => {
            eprintln!("skipping: {var} not set (eval \"$(scripts/servers.sh env)\")");
            None
        }
    }
}

/// The error of a call that must fail (the success types are not all `Debug`, so
/// `expect_err` does not apply).
pub trait Refused<E> {
    /// The error, or a panic saying `why` a refusal was expected.
    fn refused(self, why: &str) -> E;
}

impl<T, E> Refused<E> for Result<T, E> {
    fn refused(self, why: &str) -> E {
        match self {
            Ok(_) => panic!("accepted, but expected a refusal: {why}"),
            Err(e) => e,
        }
    }
}
