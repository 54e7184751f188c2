//! Helpers the facade's integration tests share (each test file includes this module, and
//! uses only some of it).
#![allow(dead_code)]

/// The URL of a server-backed store or broker, or `None` when the test must not run (see
/// `idemq_core::testkit::servers`: a recorded skip, or a panic under `IDEMQ_REQUIRE_SERVERS=1`).
pub fn server_url(var: &str) -> Option<String> {
    idemq_core::testkit::servers::server_url(var)
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
