//! OpenDsec's lifecycle events as E2B shows them: the E2B gateway's
//! `GET /events/sandboxes` and the deliveries of webhooks made with `format: "e2b"` are
//! written from the same [`Event`]s, so programs written for E2B's lifecycle API and
//! webhooks read them unchanged.

use std::collections::BTreeMap;

use serde_json::{Value, json};

use crate::api::Event;

/// The label that keeps a sandbox's E2B template id (set by the gateway's create).
pub const TEMPLATE_LABEL: &str = "e2b.template";
/// Labels the gateway keeps for itself start so; they are not a sandbox's metadata.
pub const LABEL_PREFIX: &str = "e2b.";

/// E2B's event types, and the OpenDsec types each stands for.
pub const TYPES: &[(&str, &[&str])] = &[
    ("sandbox.lifecycle.created", &["created"]),
    ("sandbox.lifecycle.paused", &["paused"]),
    ("sandbox.lifecycle.resumed", &["resumed"]),
    ("sandbox.lifecycle.updated", &["updated"]),
    ("sandbox.lifecycle.checkpointed", &["snapshotted"]),
    ("sandbox.lifecycle.killed", &["stopped", "expired"]),
];

/// The E2B type of an OpenDsec event type; None for those E2B has no word for (`forked`:
/// each copy has its own `created`; `oom_killed`: a process died, the sandbox runs on).
pub fn e2b_type(kind: &str) -> Option<&'static str> {
    TYPES
        .iter()
        .find(|(_, native)| native.contains(&kind))
        .map(|(e, _)| *e)
}

/// The OpenDsec types an E2B type stands for; None for a type E2B does not have.
pub fn native_types(e2b: &str) -> Option<&'static [&'static str]> {
    TYPES.iter().find(|(e, _)| *e == e2b).map(|(_, n)| *n)
}

/// The event as E2B's API and webhooks show it (`version` `v1`), or None for a type E2B
/// does not have.
pub fn event(ev: &Event) -> Option<Value> {
    let kind = e2b_type(&ev.kind)?;
    let metadata: BTreeMap<&str, &str> = ev
        .labels
        .iter()
        .filter(|(k, _)| !k.starts_with(LABEL_PREFIX))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let mut data = serde_json::Map::new();
    if !metadata.is_empty() {
        data.insert("sandbox_metadata".into(), json!(metadata));
    }
    if ev.kind == "updated"
        && let Some(ms) = ev.detail.get("expires_at_ms").and_then(Value::as_u64)
    {
        data.insert("set_timeout".into(), json!(crate::rfc3339(ms)));
    }
    if let Some(r) = &ev.reason {
        data.insert("reason".into(), json!(r));
    }
    if ev.kind != "stopped" && ev.kind != "created" {
        // E2B says only `killed`; which stop it was is kept here.
        data.insert("type".into(), json!(ev.kind));
    }
    let template = ev.labels.get(TEMPLATE_LABEL).cloned().unwrap_or_default();
    Some(json!({
        "version": "v1",
        "id": ev.id,
        "type": kind,
        "eventData": if data.is_empty() { Value::Null } else { Value::Object(data) },
        "sandboxBuildId": "",
        "sandboxExecutionId": ev.sandbox,
        "sandboxId": ev.sandbox,
        "sandboxTeamId": ev.project,
        "sandboxTemplateId": template,
        "timestamp": crate::rfc3339(ev.at_ms),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: &str) -> Event {
        Event {
            id: "edge1-7".into(),
            seq: 7,
            kind: kind.into(),
            at_ms: 1_754_513_964_000,
            sandbox: "edge1-0123456789ab".into(),
            project: "root/team".into(),
            edge: "edge1".into(),
            backend: "container".into(),
            reason: None,
            labels: [
                ("e2b.template".to_string(), "base".to_string()),
                ("job".to_string(), "7".to_string()),
            ]
            .into(),
            detail: BTreeMap::new(),
        }
    }

    #[test]
    fn every_type_maps_both_ways() {
        for (e2b, natives) in TYPES {
            for n in *natives {
                assert_eq!(e2b_type(n), Some(*e2b));
            }
            assert_eq!(native_types(e2b), Some(*natives));
        }
        assert_eq!(e2b_type("forked"), None);
        assert_eq!(e2b_type("oom_killed"), None);
        assert_eq!(native_types("sandbox.lifecycle.nope"), None);
    }

    #[test]
    fn an_event_reads_as_e2b_writes_it() {
        let v = event(&ev("created")).unwrap();
        assert_eq!(v["type"], "sandbox.lifecycle.created");
        assert_eq!(v["sandboxId"], "edge1-0123456789ab");
        assert_eq!(v["sandboxTeamId"], "root/team");
        assert_eq!(v["sandboxTemplateId"], "base");
        assert_eq!(v["timestamp"], "2025-08-06T20:59:24.000Z");
        // The gateway's own labels are not metadata.
        assert_eq!(v["eventData"], json!({"sandbox_metadata": {"job": "7"}}));

        let mut e = ev("expired");
        e.labels.clear();
        let v = event(&e).unwrap();
        assert_eq!(v["type"], "sandbox.lifecycle.killed");
        assert_eq!(v["eventData"], json!({"type": "expired"}));

        let mut e = ev("updated");
        e.reason = Some("timeout".into());
        e.detail
            .insert("expires_at_ms".into(), json!(1_754_513_999_000u64));
        let v = event(&e).unwrap();
        assert_eq!(v["eventData"]["set_timeout"], "2025-08-06T20:59:59.000Z");
        assert!(event(&ev("forked")).is_none());
    }
}
