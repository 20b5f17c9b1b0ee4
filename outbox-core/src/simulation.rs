//! Hooks for the simulator (`outbox-sim`), compiled in only with the
//! `simulation` feature; without it every function here is inert and the
//! hooks compile away.
//!
//! - Deliberate defects the gate must catch (`outbox-sim --mutation NAME`):
//!   each is a one-line switch in shipped code, asked with
//!   [`mutation_active`], set for the thread a trace runs on. Defects that a
//!   component's own test catches instead (the Kafka adapter's, the
//!   consumer's) are switched for a whole test process by the environment
//!   variable [`MUTATION_ENV`]: the catching test runs itself again in a
//!   child process with it set and expects to fail.
//! - Deterministic identifiers: with [`seed_ids`], event and attempt ids
//!   generated on this thread come from a seeded generator, so that one seed
//!   gives the same trace, ids included.

#[cfg(feature = "simulation")]
thread_local! {
    static MUTATION: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
    static IDS: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// The environment variable that switches one defect on for a whole
/// process (read once; only with the `simulation` feature).
pub const MUTATION_ENV: &str = "OUTBOX_MUTATION";

#[cfg(feature = "simulation")]
fn process_mutation() -> Option<&'static str> {
    static FROM_ENV: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    FROM_ENV.get_or_init(|| std::env::var(MUTATION_ENV).ok().filter(|v| !v.is_empty())).as_deref()
}

/// Whether the defect `name` is switched on for this thread (or, by
/// [`MUTATION_ENV`], for this process).
#[inline]
pub fn mutation_active(name: &str) -> bool {
    #[cfg(feature = "simulation")]
    {
        MUTATION.with(|a| a.get() == Some(name)) || process_mutation() == Some(name)
    }
    #[cfg(not(feature = "simulation"))]
    {
        let _ = name;
        false
    }
}

/// Switches the defect `name` on for this thread (`None`: none).
pub fn set_mutation(name: Option<&'static str>) {
    #[cfg(feature = "simulation")]
    MUTATION.with(|a| a.set(name));
    #[cfg(not(feature = "simulation"))]
    let _ = name;
}

/// Makes the ids generated on this thread follow `seed` (`None`: the
/// thread RNG again).
pub fn seed_ids(seed: Option<u64>) {
    #[cfg(feature = "simulation")]
    IDS.with(|s| s.set(seed));
    #[cfg(not(feature = "simulation"))]
    let _ = seed;
}

/// The next random part of an id: from the seeded generator when
/// [`seed_ids`] set one on this thread, otherwise from the thread RNG.
#[inline]
pub fn id_random() -> u128 {
    #[cfg(feature = "simulation")]
    {
        if let Some(next) = IDS.with(|s| {
            s.get().map(|x| {
                // splitmix64, twice.
                let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
                s.set(Some(z));
                let mix = |mut v: u64| {
                    v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                    v ^ (v >> 31)
                };
                let hi = mix(z);
                z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
                s.set(Some(z));
                ((hi as u128) << 64) | mix(z) as u128
            })
        }) {
            return next;
        }
    }
    rand::random::<u128>()
}
