//! `crates/common/openapi.json`, the document every apiserver serves at `/openapi.json`,
//! is generated (`dsec_edge_api::openapi`): the operations from the handlers'
//! `#[utoipa::path]` attributes, the schemas from the API's own types. This test fails
//! when the committed document is not what they generate; run it with
//! `DSEC_WRITE_OPENAPI=1` to write it.

use serde_json::Value;

fn path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../common/openapi.json")
}

#[test]
fn the_served_document_is_the_generated_one() {
    let want = dsec_edge_api::openapi::json();
    let path = path();
    if std::env::var_os("DSEC_WRITE_OPENAPI").is_some() {
        std::fs::write(&path, &want).unwrap();
    }
    let have = std::fs::read_to_string(&path).unwrap();
    assert!(
        have == want,
        "{} is stale: the API's handlers or types changed; regenerate it with \
         `DSEC_WRITE_OPENAPI=1 cargo test -p dsec-edge-api --test openapi` and commit it",
        path.display()
    );
    // What is served is that file.
    assert_eq!(dsec_common::http::OPENAPI, have);
}

/// Every `$ref` in the document names a schema or a response it has (an operation that
/// names a type the document does not carry fails here).
#[test]
fn every_reference_resolves() {
    let doc: Value = serde_json::from_str(&dsec_edge_api::openapi::json()).unwrap();
    fn walk(v: &Value, doc: &Value, bad: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                if let Some(Value::String(r)) = m.get("$ref") {
                    let ptr = r.trim_start_matches('#');
                    if doc.pointer(ptr).is_none() {
                        bad.push(r.clone());
                    }
                }
                m.values().for_each(|x| walk(x, doc, bad));
            }
            Value::Array(a) => a.iter().for_each(|x| walk(x, doc, bad)),
            _ => {}
        }
    }
    let mut bad = Vec::new();
    walk(&doc, &doc, &mut bad);
    assert!(bad.is_empty(), "unresolved references: {bad:?}");
}

/// Every operation says what it answers and declares its path parameters; the two that take no key (health, and the port proxy,
/// which also takes a sandbox's port token) say so.
#[test]
fn every_operation_is_complete() {
    let doc: Value = serde_json::from_str(&dsec_edge_api::openapi::json()).unwrap();
    let mut open = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let what = format!("{method} {path}");
            assert!(op["summary"].is_string(), "{what} has no summary");
            let responses = op["responses"].as_object().unwrap();
            assert!(
                responses.keys().any(|s| s.starts_with('2')),
                "{what} names no success"
            );
            if op.get("security") == Some(&serde_json::json!([{}])) {
                open.push(what.clone());
            } else {
                assert!(op.get("security").is_none(), "{what}: {}", op["security"]);
            }
            for p in path.split('/').filter_map(|s| s.strip_prefix('{')) {
                let name = p.split('}').next().unwrap();
                let declared = op["parameters"].as_array().is_some_and(|ps| {
                    ps.iter()
                        .any(|x| x["name"] == name && x["in"] == "path" && x["required"] == true)
                });
                assert!(
                    declared,
                    "{what} does not declare its path parameter {name}"
                );
            }
        }
    }
    assert_eq!(
        open,
        ["get /healthz", "get /v1/sandboxes/{id}/ports/{port}/{path}"]
    );
}
