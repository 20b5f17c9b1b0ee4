//! The consumer registry and the consumers' watermarks, as the PostgreSQL
//! store's `outbox_consumers` and `outbox_consumer_watermarks`: what
//! retention and the comparison read.

use super::{MemoryConsumer, MemoryStore, MemoryWatermark};

impl MemoryStore {
    /// Replaces the consumer registry and the watermarks (the PostgreSQL
    /// store's `outbox_consumers` and `outbox_consumer_watermarks`) with
    /// these mandatory consumers (id, topics they read) and watermarks:
    /// what retention reads.
    pub fn set_retention_registry(&self, mandatory: Vec<(String, Vec<String>)>, watermarks: Vec<MemoryWatermark>) {
        let mut st = self.lock();
        st.consumers = mandatory.into_iter().map(|(id, topics)| (id, MemoryConsumer { critical: false, mandatory: true, topics })).collect();
        st.watermarks = watermarks;
    }

    /// Registers (or replaces) a consumer.
    pub fn register_consumer(&self, consumer_id: &str, consumer: MemoryConsumer) {
        self.lock().consumers.insert(consumer_id.to_owned(), consumer);
    }

    /// Sets a consumer's watermark on its log (replacing the one it had there).
    pub fn set_watermark(&self, watermark: MemoryWatermark) {
        let mut st = self.lock();
        let same_log = |w: &MemoryWatermark| w.consumer_id == watermark.consumer_id && w.log == watermark.log;
        st.watermarks.retain(|w| !same_log(w));
        st.watermarks.push(watermark);
    }
}
