//! What a web page in the user's browser may do with the head. hearth listens on loopback
//! with no key by default, and a browser sends a page's requests wherever the page says:
//! these rules keep other sites' pages out unless the user lets them in.
//!
//! - The `Host` check, against DNS rebinding: a page whose own name is made to resolve to
//!   the head would otherwise read every answer as its own origin. A request must name the
//!   head by an IP address, `localhost`, this machine's host name, or a name of
//!   `--allowed-hosts`; any other name is refused on every route.
//! - JSON routes take only JSON ([`json_content`]): the bodies any page may send anywhere
//!   without asking first (a form's, `text/plain`, no type at all) never run.
//! - CORS is off unless `--cors-origins` names the origins whose pages may call the API
//!   and read its answers; the console is the head's own origin and needs none.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::{ApiError, AppState};

/// How long a browser may keep a preflight's answer: the origins only change with a
/// restart, and a preflight before every chat request would add a round trip to each.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// A refused Host or content type is quoted in the refusal up to this many characters:
/// enough for any real one, and a client cannot make the answer large.
const QUOTED_CHARS: usize = 100;

/// `--allowed-hosts` and `--cors-origins`, checked once at start.
#[derive(Debug, Clone, Default)]
pub struct WebPolicy {
    /// Names a request's Host may be beyond the ones always served: lower case, no
    /// trailing dot.
    names: Vec<String>,
    /// `*.example.com` entries, kept as `.example.com`.
    suffixes: Vec<String>,
    /// `--allowed-hosts '*'`: no check (behind a reverse proxy, which checks names itself).
    any_host: bool,
    /// This machine's host name, lower case: a name the LAN resolves, which no page's
    /// server can make a browser resolve to the head.
    own_name: Option<String>,
    cors: Option<Cors>,
}

#[derive(Debug, Clone)]
enum Cors {
    /// `--cors-origins '*'`: any page may call the API (it still needs the key, if any).
    Any,
    Origins(Vec<HeaderValue>),
}

impl WebPolicy {
    /// The policy of `--allowed-hosts` and `--cors-origins` (empty entries ignored, so
    /// that `HEARTH_ALLOWED_HOSTS=hearth,` is `hearth`); an error names a bad entry.
    pub fn new(allowed_hosts: &[String], cors_origins: &[String]) -> Result<WebPolicy, String> {
        let mut policy = WebPolicy { own_name: crate::process::hostname().map(|n| normal_name(&n)), ..WebPolicy::default() };
        for entry in allowed_hosts.iter().map(|h| h.trim()).filter(|h| !h.is_empty()) {
            if entry == "*" {
                policy.any_host = true;
            } else if let Some(domain) = entry.strip_prefix("*.").or_else(|| entry.strip_prefix('.')) {
                policy.suffixes.push(format!(".{}", normal_name(domain)));
            } else if entry.contains(['/', ':', '@', ' ']) {
                return Err(format!("--allowed-hosts {entry}: a host name without scheme or port is expected (e.g. hearth.local or *.home.arpa)"));
            } else {
                policy.names.push(normal_name(entry));
            }
        }
        let origins: Vec<&str> = cors_origins.iter().map(|o| o.trim().trim_end_matches('/')).filter(|o| !o.is_empty()).collect();
        if origins.contains(&"*") {
            policy.cors = Some(Cors::Any);
        } else if !origins.is_empty() {
            let parsed = origins.iter().map(|o| {
                let authority = o.strip_prefix("http://").or_else(|| o.strip_prefix("https://"));
                let ok = authority.is_some_and(|a| !a.is_empty() && !a.contains(['/', '?', '#', '@', ' ']));
                ok.then(|| HeaderValue::from_str(o).ok()).flatten().ok_or_else(|| format!("--cors-origins {o}: an origin is scheme://host[:port], e.g. http://localhost:3000"))
            });
            policy.cors = Some(Cors::Origins(parsed.collect::<Result<_, _>>()?));
        }
        Ok(policy)
    }

    /// Whether a request naming `host` (a `Host` header's value, port included) is served.
    pub fn allows_host(&self, host: &str) -> bool {
        if self.any_host {
            return true;
        }
        let host = host.trim();
        // An IP address names no site: a rebinding page must have a name of its own, and a
        // page at `http://<address>` talks to whatever listens there. Any address, not only
        // this machine's: behind Docker's port mapping or a NAT the head is reached at an
        // address it does not have.
        if let Some(v6) = host.strip_prefix('[') {
            return v6.split_once(']').is_some_and(|(ip, port)| ip.parse::<IpAddr>().is_ok() && (port.is_empty() || is_port(port)));
        }
        if host.parse::<IpAddr>().is_ok() {
            return true;
        }
        let name = match host.rsplit_once(':') {
            Some((name, port)) if is_port(&format!(":{port}")) => name,
            Some(_) => return false,
            None => host,
        };
        if name.parse::<IpAddr>().is_ok() {
            return true;
        }
        let name = normal_name(name);
        // `localhost` and its subdomains are loopback by rule (RFC 6761); browsers resolve
        // them so themselves.
        name == "localhost"
            || name.ends_with(".localhost")
            || self.own_name.as_deref() == Some(name.as_str())
            || self.names.contains(&name)
            || self.suffixes.iter().any(|s| name.ends_with(s.as_str()))
    }

    /// The CORS layer of `--cors-origins`, or `None` (the default): no grant, and browsers
    /// keep other origins' pages from reading any answer.
    pub fn cors(&self) -> Option<CorsLayer> {
        let origins = match self.cors.as_ref()? {
            Cors::Any => AllowOrigin::any(),
            Cors::Origins(list) => AllowOrigin::list(list.clone()),
        };
        Some(
            CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([Method::GET, Method::HEAD, Method::POST, Method::DELETE])
                // Mirrored, not `*`: a wildcard does not cover `Authorization`, which the
                // SDKs send with every request.
                .allow_headers(AllowHeaders::mirror_request())
                .expose_headers([header::RETRY_AFTER])
                .max_age(PREFLIGHT_MAX_AGE),
        )
    }
}

fn is_port(colon_port: &str) -> bool {
    colon_port.strip_prefix(':').is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// A host name as compared: lower case, without the trailing dot of a fully qualified one.
fn normal_name(name: &str) -> String {
    name.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// Layer of every route: a request whose `Host` (or absolute URI) names the head by a name
/// it does not answer to is refused with 403, in the envelope of the API the path belongs
/// to, before anything runs. No `Host` at all (HTTP/1.0, a bare probe) passes: a browser
/// always sends one.
pub async fn check_host(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let named = req.headers().get_all(header::HOST).iter().map(|v| v.to_str().unwrap_or("\u{fffd}")).chain(req.uri().authority().map(|a| a.as_str()));
    let refused = named.filter(|h| !h.is_empty()).find(|h| !state.web.allows_host(h)).map(|h| h.chars().take(QUOTED_CHARS).collect::<String>());
    match refused {
        Some(host) => ApiError::HostNotAllowed(host).into_response_at(req.uri().path()),
        None => next.run(req).await,
    }
}

/// Whether a JSON route takes this body: `Content-Type: application/json` (or a
/// `+json` type), or no type at all from a client that is not a browser. A browser may
/// send a form, `text/plain` or an untyped body (a `Blob`, an `ArrayBuffer`) to any
/// address without asking the server first, and always says where from (`Origin`); the
/// SDKs, Ollama's clients and curl with `-H 'Content-Type: application/json'` or `--json`
/// send JSON's type, and scripts that send none send no `Origin` either.
pub fn json_content(headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(given) = headers.get(header::CONTENT_TYPE) else {
        if headers.contains_key(header::ORIGIN) {
            return Err(ApiError::UnsupportedMediaType(None));
        }
        return Ok(());
    };
    let text = given.to_str().unwrap_or("");
    let essence = text.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let json = essence == "application/json" || essence.strip_prefix("application/").is_some_and(|sub| sub.ends_with("+json"));
    if !json {
        return Err(ApiError::UnsupportedMediaType(Some(text.chars().take(QUOTED_CHARS).collect())));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(hosts: &[&str]) -> WebPolicy {
        let mut p = WebPolicy::new(&hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>(), &[]).unwrap();
        p.own_name = Some("desk".into());
        p
    }

    #[test]
    fn addresses_loopback_names_and_the_own_name_are_served_and_other_names_are_not() {
        let p = policy(&[]);
        for ok in ["127.0.0.1", "127.0.0.1:8080", "[::1]:8080", "[::1]", "192.168.1.20:8080", "10.0.0.2", "localhost", "LOCALHOST:8080", "localhost.:8080", "app.localhost:80", "desk", "Desk:8080"] {
            assert!(p.allows_host(ok), "{ok}");
        }
        for no in ["evil.example", "evil.example:8080", "127.0.0.1.nip.io", "localhost.evil.example", "hearth.local", "desk.evil.example", "[::1", "[evil]:80", "a:b", "localhost:80:80", "localhost:http"] {
            assert!(!p.allows_host(no), "{no}");
        }
    }

    #[test]
    fn the_allow_list_adds_names_and_domains_and_a_star_turns_the_check_off() {
        let p = policy(&["hearth.local", "*.home.arpa", " ", "Box.Lan."]);
        for ok in ["hearth.local", "hearth.local:8080", "pc.home.arpa", "a.b.home.arpa:1", "box.lan"] {
            assert!(p.allows_host(ok), "{ok}");
        }
        for no in ["home.arpa", "evilhome.arpa", "x.hearth.local"] {
            assert!(!p.allows_host(no), "{no}");
        }
        assert!(policy(&["*"]).allows_host("anything.example"));
        assert!(WebPolicy::new(&["http://hearth.local".into()], &[]).is_err());
        assert!(WebPolicy::new(&["hearth.local:8080".into()], &[]).is_err());
    }

    #[test]
    fn origins_must_be_scheme_host_and_port() {
        assert!(WebPolicy::new(&[], &["http://localhost:3000/".into(), "https://app.example".into()]).is_ok());
        assert!(WebPolicy::new(&[], &["*".into()]).unwrap().cors().is_some());
        assert!(WebPolicy::new(&[], &[]).unwrap().cors().is_none());
        for bad in ["localhost:3000", "http://app.example/path", "ftp://x"] {
            assert!(WebPolicy::new(&[], &[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_json_bodies_are_taken_and_untyped_ones_only_from_outside_a_browser() {
        let with = |pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(), HeaderValue::from_str(v).unwrap());
            }
            json_content(&h)
        };
        assert!(with(&[("content-type", "application/json")]).is_ok());
        assert!(with(&[("content-type", "Application/JSON; charset=utf-8")]).is_ok());
        assert!(with(&[("content-type", "application/vnd.api+json")]).is_ok());
        assert!(with(&[]).is_ok());
        assert!(with(&[("origin", "https://evil.example")]).is_err());
        for forged in ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonp", ""] {
            assert!(with(&[("content-type", forged)]).is_err(), "{forged}");
        }
    }
}
