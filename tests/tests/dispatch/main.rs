//! The dispatcher on real PostgreSQL and librdkafka's in-process Kafka
//! cluster, one test binary (its tests run in parallel) with a file per
//! concern.

mod claims;
mod db_faults;
mod delivery;
mod destinations;
mod index_use;
mod run;
mod stream;
mod stream_faults;
mod wakeup;
