//! Keeping credentials out of logs, errors and `Debug` output.
//!
//! Every store and adapter formats URLs and client properties through these helpers before
//! they reach an error message, a log line or a `Debug` impl, so a password given in a URL
//! (`postgres://app:pw@db/billing`) or a property (`sasl.password`) is never printed.

/// `url` with the password of its user info replaced by `***`.
///
/// ```
/// use idemq_core::secrets::redact_url;
/// assert_eq!(redact_url("postgres://app:pw@db:5432/billing"), "postgres://app:***@db:5432/billing");
/// assert_eq!(redact_url("redis://:pw@cache:6379/0"), "redis://:***@cache:6379/0");
/// assert_eq!(redact_url("amqp://guest@mq/%2f"), "amqp://guest@mq/%2f");
/// assert_eq!(redact_url("sqlite::memory:"), "sqlite::memory:");
/// ```
pub fn redact_url(url: &str) -> String {
    match password_span(url) {
        Some(span) => format!("{}***{}", &url[..span.start], &url[span.end..]),
        None => url.to_owned(),
    }
}

/// Where the password of `url` stands (byte range), if it has one: between the user and the
/// `@` of the authority's user info. For text that is not a URL (a typo such as
/// `postgres//app:pw@db`) whatever could be a password, between the first `:` and the
/// last `@`.
fn password_span(url: &str) -> Option<std::ops::Range<usize>> {
    let Some(scheme_end) = url.find("://") else {
        let (colon, at) = (url.find(':')?, url.rfind('@')?);
        return (colon < at).then(|| colon + 1..at);
    };
    let start = scheme_end + 3;
    let rest = &url[start..];
    // The user info ends at the last '@' before the path (a password may hold '@' only
    // percent-encoded, but be generous: take the last one of the authority part).
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let at = rest[..authority_end].rfind('@')?;
    let colon = rest[..at].find(':')?;
    Some(start + colon + 1..start + at)
}

/// `text` (a driver's error message about `url`) with the URL's password replaced by
/// `***` wherever it appears, raw or percent-decoded: drivers may echo what they were given.
///
/// ```
/// use idemq_core::secrets::scrub;
/// let url = "amqp://app:hunter2@mq:5672/%2f";
/// assert_eq!(scrub("login as app/hunter2 refused", url), "login as app/*** refused");
/// ```
pub fn scrub(text: &str, url: &str) -> String {
    match password_span(url).map(|span| &url[span]) {
        Some(pw) if !pw.is_empty() => {
            let mut out = text.replace(pw, "***");
            let decoded = percent_decode(pw);
            if !decoded.is_empty() && decoded != pw {
                out = out.replace(&decoded, "***");
            }
            out
        }
        _ => text.to_owned(),
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() && s.is_char_boundary(i + 3) {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether a client property (librdkafka, RocketMQ, a driver option) holds a secret:
/// its name mentions a password, a secret, a credential, a token or a JAAS config.
///
/// ```
/// use idemq_core::secrets::is_secret_property;
/// assert!(is_secret_property("sasl.password"));
/// assert!(is_secret_property("sasl.oauthbearer.client.secret"));
/// assert!(!is_secret_property("bootstrap.servers"));
/// ```
pub fn is_secret_property(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    [
        "password",
        "secret",
        "credential",
        "token",
        "jaas",
        "private.key",
    ]
    .iter()
    .any(|s| n.contains(s))
}

/// The value to show for property `name`: `***` when it is a secret.
pub fn shown_value<'a>(name: &str, value: &'a str) -> &'a str {
    if is_secret_property(name) {
        "***"
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_info_passwords_are_hidden_wherever_the_url_goes() {
        assert_eq!(
            redact_url("mysql://u:secret@h:1/db"),
            "mysql://u:***@h:1/db"
        );
        assert_eq!(redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(
            redact_url("redis+cluster://:pw@a:1,b:2/"),
            "redis+cluster://:***@a:1,b:2/"
        );
        // An '@' in the path or query is not user info.
        assert_eq!(
            redact_url("postgres://h/db?application_name=a@b"),
            "postgres://h/db?application_name=a@b"
        );
        assert_eq!(redact_url("amqp://u:p@ss@h/%2f"), "amqp://u:***@h/%2f");
        assert_eq!(redact_url("postgres//u:pw@h/db"), "postgres//u:***@h/db");
    }

    #[test]
    fn scrub_hides_the_password_raw_and_decoded() {
        let url = "postgres://app:p%40ss@db/billing";
        assert_eq!(scrub("bad password p%40ss", url), "bad password ***");
        assert_eq!(scrub("bad password p@ss", url), "bad password ***");
        assert_eq!(scrub("no secret here", "postgres://db/x"), "no secret here");
        assert_eq!(percent_decode("a%2"), "a%2");
    }

    #[test]
    fn token_and_key_properties_are_secret() {
        assert!(is_secret_property("ssl.key.password"));
        assert!(is_secret_property("sasl.jaas.config"));
        assert!(is_secret_property("secretKey"));
        assert_eq!(shown_value("sasl.password", "hunter2"), "***");
        assert_eq!(shown_value("acks", "all"), "all");
    }
}
