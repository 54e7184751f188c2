//! The core contract kit on PostgreSQL: eight handles with separate pools race on the same
//! keys. Needs `IDEMQ_TEST_POSTGRES_URL` (skipped without it unless
//! `IDEMQ_REQUIRE_SERVERS=1`).
#![cfg(feature = "postgres")]

mod support;

idemq_core::store_contract_tests!(support::postgres_handles(8));
