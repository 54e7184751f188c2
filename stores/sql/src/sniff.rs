//! Which server answers at a host and port: the shared [`idemq_probe`] crate.

pub(crate) use idemq_probe::*;
