//! [`ConfigError`]: every refusal names the setting it is about and never
//! repeats a value that may be a secret.

/// A setting is missing, malformed or out of its limits. `setting` is its
/// path in the file (`consumer.fulfilment.keys`, `kafka.settings.acks`) or
/// the environment variable it came from (`OUTBOX_CONSUMER_VERIFY_KEYS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    setting: String,
    message: String,
}

impl ConfigError {
    /// An error about `setting`.
    pub fn new(setting: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { setting: setting.into(), message: message.into() }
    }

    /// The setting the error is about.
    pub fn setting(&self) -> &str {
        &self.setting
    }

    /// What is wrong with it.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.setting, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// The text of an SDK configuration error without its crate's prefix
/// (`configuration: `, `invalid consumer configuration: `...).
pub(crate) fn producer_text(e: &outbox_producer::ProducerError) -> String {
    match e {
        outbox_producer::ProducerError::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

pub(crate) fn consumer_text(e: &outbox_consumer::ConsumerError) -> String {
    match e {
        outbox_consumer::ConsumerError::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

pub(crate) fn kafka_text(e: &outbox_producer::kafka::KafkaAdapterError) -> String {
    match e {
        outbox_producer::kafka::KafkaAdapterError::Config(m) => m.clone(),
        other => other.to_string(),
    }
}

/// A TOML error as "line N: what", with every quoted text replaced by `"…"`
/// (serde echoes a value of the wrong type; it may be a secret), and the
/// setting the line names when it can be told: the table header above the
/// line and the key at its start (never its value).
pub(crate) fn toml_error(origin: &str, text: &str, e: &toml::de::Error) -> ConfigError {
    let message = redact_quoted(e.message().lines().next().unwrap_or("invalid TOML"));
    let Some(span) = e.span() else {
        return ConfigError::new(origin, message);
    };
    let start = span.start.min(text.len());
    let line_no = text[..start].matches('\n').count() + 1;
    let lines: Vec<&str> = text.lines().collect();
    let mut table = String::new();
    for l in lines.iter().take(line_no.saturating_sub(1)) {
        let t = l.trim();
        if t.starts_with('[') {
            table = t.trim_start_matches('[').trim_end_matches(']').trim().to_owned();
        }
    }
    let line = lines.get(line_no - 1).map(|l| l.trim()).unwrap_or("");
    if line.starts_with('[') {
        table = line.trim_start_matches('[').trim_end_matches(']').trim().to_owned();
    }
    let key = line.split_once('=').map(|(k, _)| k.trim().trim_matches('"').to_owned()).filter(|k| !k.is_empty() && !k.starts_with('['));
    let setting = match (table.is_empty(), key) {
        (true, Some(k)) => k,
        (false, Some(k)) => format!("{table}.{k}"),
        (false, None) => table,
        (true, None) => origin.to_owned(),
    };
    ConfigError::new(setting, format!("{origin} line {line_no}: {message}"))
}

fn redact_quoted(m: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for c in m.chars() {
        if c == '"' {
            if inside {
                out.push_str("…\"");
            } else {
                out.push('"');
            }
            inside = !inside;
        } else if !inside {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn quoted_text_is_redacted() {
        assert_eq!(super::redact_quoted(r#"invalid type: string "hunter2", expected usize"#), r#"invalid type: string "…", expected usize"#);
    }
}
