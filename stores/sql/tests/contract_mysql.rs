//! The core contract kit on MySQL/MariaDB: eight handles with separate pools race on the
//! same keys. Needs `IDEMQ_TEST_MYSQL_URL` (skipped without it unless
//! `IDEMQ_REQUIRE_SERVERS=1`).
#![cfg(feature = "mysql")]

mod support;

idemq_core::store_contract_tests!(support::mysql_handles(8));

/// The same kit on sessions in MariaDB's SIMULTANEOUS_ASSIGNMENT mode, which changes how
/// `ON DUPLICATE KEY UPDATE` assignments see each other.
mod simultaneous_assignment {
    use super::support;
    idemq_core::store_contract_tests!(support::mysql_handles_simultaneous(8));
}
