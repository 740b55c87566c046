//! docs/firecracker-compat.md and docs/cloud-hypervisor-compat.md stay in step with the
//! code: every route their tables list is sent to a live gpuvm in that mode. A route the
//! doc calls supported must be known to the front end (not "no such route", not "method
//! not allowed", not a "not supported" refusal); one it calls not supported must be
//! refused with 400 and the message the doc quotes. A front end that learns a route, or
//! drops one, fails here until the doc says so.

use std::path::Path;

use gpuvm_tests::{gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

/// One table row's route: method, path (as sent), and what the doc says of it.
#[derive(Debug)]
struct Row {
    method: String,
    path: String,
    supported: bool,
    /// The longest literal piece of the refusal the doc quotes (not-supported rows).
    quoted: Option<String>,
}

const METHODS: [&str; 4] = ["GET", "PUT", "PATCH", "DELETE"];

/// The backticked pieces of `cell`.
fn backticked(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The longest piece of a quoted refusal between placeholders (`...`, `<METHOD>`).
fn literal_piece(quoted: &str) -> Option<String> {
    quoted
        .split("...")
        .flat_map(|piece| piece.split(['<', '>']).step_by(2))
        .map(str::trim)
        .max_by_key(|piece| piece.len())
        .filter(|piece| piece.len() >= 12)
        .map(str::to_string)
}

/// The route rows of a doc's tables; `prefix` goes before paths that do not start with
/// a slash (Cloud Hypervisor's `vm.boot`).
fn rows(doc: &str, prefix: &str) -> Vec<Row> {
    let mut rows = Vec::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split(" | ").collect();
        if !line.starts_with("| `") || cells.len() < 2 {
            continue;
        }
        let status = cells[1].trim();
        let supported = !status.starts_with("not supported");
        let quoted = if supported {
            None
        } else {
            backticked(status).into_iter().find_map(literal_piece)
        };
        let mut methods: Vec<&str> = Vec::new();
        for token in backticked(cells[0].trim_start_matches("| ")) {
            if METHODS.contains(&token) {
                methods.push(token);
                continue;
            }
            let Some((method, path)) = token.split_once(' ') else {
                continue;
            };
            if !METHODS.contains(&method) {
                continue;
            }
            methods.push(method);
            let path = if path.starts_with('/') {
                path.to_string()
            } else {
                format!("{prefix}{path}")
            };
            // Path parameters: any id will do.
            let path: String = path
                .split('/')
                .map(|part| if part.starts_with('{') { "id0" } else { part })
                .collect::<Vec<_>>()
                .join("/");
            for method in methods.drain(..) {
                rows.push(Row {
                    method: method.to_string(),
                    path: path.clone(),
                    supported,
                    quoted: quoted.clone(),
                });
            }
        }
    }
    rows
}

/// Sends every row's request (body `{}` for writes) to `api` and collects the mismatches.
fn check(api: &Path, rows: &[Row]) -> Vec<String> {
    let mut wrong = Vec::new();
    for row in rows {
        // Routes that end the process are checked by the front ends' own tests.
        if row.path.contains("shutdown") {
            continue;
        }
        let body = (row.method != "GET").then_some("{}");
        let response = gpuvm_api::client::request(api, &row.method, &row.path, body)
            .unwrap_or_else(|e| panic!("{} {}: {e}", row.method, row.path));
        let (status, answer) = (response.status, response.body);
        let unknown = answer.contains("no such route") || answer.contains("method not allowed");
        let refused = answer.contains("not supported") || answer.contains("not implemented");
        if row.supported {
            if unknown || (status == 400 && refused) {
                wrong.push(format!(
                    "{} {}: the doc says supported, gpuvm answers {status} {answer}",
                    row.method, row.path
                ));
            }
        } else {
            let quoted_ok = row
                .quoted
                .as_ref()
                .is_none_or(|q| answer.contains(q.as_str()));
            if status != 400 || !quoted_ok {
                wrong.push(format!(
                    "{} {}: the doc says not supported ({:?}), gpuvm answers {status} {answer}",
                    row.method, row.path, row.quoted
                ));
            }
        }
    }
    wrong
}

fn start(scratch: &Scratch, name: &str, args: &[&str], api: &Path) -> SpawnedProcess {
    let link = scratch.path(name);
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let mut vmm = SpawnedProcess::spawn(&link, args);
    wait_for_api_socket(&mut vmm, api);
    vmm
}

fn doc(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../docs")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn the_firecracker_doc_matches_the_front_end() {
    let rows = rows(&doc("firecracker-compat.md"), "");
    assert!(
        rows.len() >= 30,
        "only {} routes parsed: {rows:?}",
        rows.len()
    );
    assert!(rows.iter().any(|r| !r.supported), "no refused route parsed");
    let scratch = Scratch::new("compat-docs", "firecracker");
    let api = scratch.path("fc.sock");
    let vmm = start(
        &scratch,
        "firecracker",
        &["--api-sock", api.to_str().unwrap()],
        &api,
    );
    let wrong = check(&api, &rows);
    drop(vmm);
    assert!(
        wrong.is_empty(),
        "docs/firecracker-compat.md is out of step:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_cloud_hypervisor_doc_matches_the_front_end() {
    let rows = rows(&doc("cloud-hypervisor-compat.md"), "/api/v1/");
    assert!(
        rows.len() >= 25,
        "only {} routes parsed: {rows:?}",
        rows.len()
    );
    assert!(rows.iter().any(|r| !r.supported), "no refused route parsed");
    let scratch = Scratch::new("compat-docs", "cloud-hypervisor");
    let api = scratch.path("ch.sock");
    let vmm = start(
        &scratch,
        "cloud-hypervisor",
        &["--api-socket", api.to_str().unwrap()],
        &api,
    );
    let wrong = check(&api, &rows);
    drop(vmm);
    assert!(
        wrong.is_empty(),
        "docs/cloud-hypervisor-compat.md is out of step:\n{}",
        wrong.join("\n")
    );
}

/// api/cloud-hypervisor-openapi.json (what scripts/api-fuzz-ch.sh fuzzes) describes the
/// front end's routes, no more and no fewer: the same method, path and supported-or-refused
/// as the doc's route table (which the test above holds to the front end), and a live gpuvm
/// knows each described operation (a refused one is 400) and answers 405 to the methods
/// the description leaves out.
#[test]
fn the_cloud_hypervisor_openapi_description_matches_the_front_end() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../api/cloud-hypervisor-openapi.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let spec: serde_json::Value = serde_json::from_str(&text).unwrap();
    let paths = spec["paths"]
        .as_object()
        .expect("no paths in the description");
    let mut described = Vec::new();
    for (route, operations) in paths {
        for (method, operation) in operations.as_object().unwrap() {
            let codes = operation["responses"].as_object().unwrap();
            described.push(Row {
                method: method.to_uppercase(),
                path: route.clone(),
                supported: codes.keys().any(|code| code.starts_with('2')),
                quoted: None,
            });
        }
    }
    let key = |r: &Row| (r.method.clone(), r.path.clone(), r.supported);
    let mut from_spec: Vec<_> = described.iter().map(key).collect();
    let mut from_doc: Vec<_> = rows(&doc("cloud-hypervisor-compat.md"), "/api/v1/")
        .iter()
        .map(key)
        .collect();
    from_spec.sort();
    from_doc.sort();
    let only_spec: Vec<_> = from_spec.iter().filter(|r| !from_doc.contains(r)).collect();
    let only_doc: Vec<_> = from_doc.iter().filter(|r| !from_spec.contains(r)).collect();
    assert!(
        only_spec.is_empty() && only_doc.is_empty(),
        "api/cloud-hypervisor-openapi.json and docs/cloud-hypervisor-compat.md disagree \
         (method, path, supported):\nonly in the description: {only_spec:?}\nonly in the doc: {only_doc:?}"
    );
    assert!(described.len() >= 25, "only {} operations", described.len());

    let scratch = Scratch::new("compat-docs", "ch-openapi");
    let api = scratch.path("ch.sock");
    let vmm = start(
        &scratch,
        "cloud-hypervisor",
        &["--api-socket", api.to_str().unwrap()],
        &api,
    );
    let mut wrong = check(&api, &described);
    for route in paths.keys() {
        for method in METHODS {
            if paths[route].get(method.to_lowercase()).is_some() {
                continue;
            }
            let body = (method != "GET").then_some("{}");
            let response = gpuvm_api::client::request(&api, method, route, body)
                .unwrap_or_else(|e| panic!("{method} {route}: {e}"));
            if response.status != 405 {
                wrong.push(format!(
                    "{method} {route}: not in the description, gpuvm answers {} {}",
                    response.status, response.body
                ));
            }
        }
    }
    drop(vmm);
    assert!(
        wrong.is_empty(),
        "api/cloud-hypervisor-openapi.json is out of step with the front end:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn rows_are_parsed_from_both_table_shapes() {
    let table = "| `GET`/`PUT /balloon` | not supported: 400 `<METHOD> /balloon: the balloon device is not supported by gpuvm` |\n\
                 | `PUT /drives/{drive_id}` | supported with differences |\n\
                 | `PUT vm.resize` | not supported: 400 `... gpuvm has no vCPU or memory hot-plug` |\n";
    let parsed = rows(table, "/api/v1/");
    let summary: Vec<(String, String, bool)> = parsed
        .iter()
        .map(|r| (r.method.clone(), r.path.clone(), r.supported))
        .collect();
    assert_eq!(
        summary,
        [
            ("GET".to_string(), "/balloon".to_string(), false),
            ("PUT".to_string(), "/balloon".to_string(), false),
            ("PUT".to_string(), "/drives/id0".to_string(), true),
            ("PUT".to_string(), "/api/v1/vm.resize".to_string(), false),
        ]
    );
    assert_eq!(
        parsed[0].quoted.as_deref(),
        Some("/balloon: the balloon device is not supported by gpuvm")
    );
    assert_eq!(
        parsed[3].quoted.as_deref(),
        Some("gpuvm has no vCPU or memory hot-plug")
    );
}

/// The flags in the first cells of the Cloud Hypervisor doc's command-line table
/// (`| \`--cmdline <text>\`, \`--initramfs <path>\` | ...`).
fn command_line_flags(doc: &str) -> Vec<String> {
    let mut flags: Vec<String> = doc
        .lines()
        .filter(|line| line.starts_with("| `-"))
        .filter_map(|line| line.split(" | ").next())
        .flat_map(backticked)
        .filter_map(|cell| cell.split([' ', '=']).next())
        .filter(|flag| flag.starts_with('-'))
        .map(str::to_string)
        .collect();
    flags.dedup();
    flags
}

/// The command-line table and the `cloud-hypervisor` front end agree both ways: every
/// flag the doc lists is taken (not refused as unknown to the mode), and every flag the
/// front end says it takes (its refusal of an unknown option lists them) is in the doc.
#[test]
fn the_cloud_hypervisor_command_line_table_matches_the_front_end() {
    let doc = doc("cloud-hypervisor-compat.md");
    let flags = command_line_flags(&doc);
    assert!(
        flags.len() >= 15,
        "only {} flags parsed: {flags:?}",
        flags.len()
    );
    let run = |args: &[&str]| {
        let out = std::process::Command::new(gpuvm_bin())
            .arg("ch")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    const UNKNOWN: &str = "not supported by gpuvm's Cloud Hypervisor mode";
    let wrong: Vec<&String> = flags
        .iter()
        // Each flag alone: a missing value or a missing --api-socket, never "unknown".
        .filter(|flag| run(&[flag.as_str()]).contains(UNKNOWN))
        .collect();
    assert!(
        wrong.is_empty(),
        "the doc lists flags the front end refuses: {wrong:?}"
    );
    let refusal = run(&["--frobnicate"]);
    let taken = refusal
        .split_once("(it takes ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(list, _)| list)
        .unwrap_or_else(|| panic!("no list of flags in {refusal:?}"));
    let missing: Vec<&str> = taken
        .split(", ")
        .filter(|flag| !flags.iter().any(|f| f == flag))
        .collect();
    assert!(
        missing.is_empty(),
        "flags missing from the doc's table: {missing:?}"
    );
}

/// The "Jailer" section's flag table and the `jailer` front end agree both ways: every
/// flag the doc lists is taken (not refused as unknown), and every flag of the usage the
/// jailer prints with an unknown one is in the doc.
#[test]
fn the_jailer_flag_table_matches_the_front_end() {
    let doc = doc("firecracker-compat.md");
    let section = doc
        .split_once("\n## Jailer\n")
        .and_then(|(_, rest)| rest.split("\n## ").next())
        .expect("a Jailer section");
    let flags = command_line_flags(section);
    assert!(
        flags.len() >= 12,
        "only {} flags parsed: {flags:?}",
        flags.len()
    );
    let run = |args: &[&str]| {
        let out = std::process::Command::new(gpuvm_bin())
            .arg("jailer")
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    const UNKNOWN: &str = "unknown argument";
    let wrong: Vec<&String> = flags
        .iter()
        // Each flag alone: a missing value or a missing --id, never "unknown".
        .filter(|flag| run(&[flag.as_str()]).contains(UNKNOWN))
        .collect();
    assert!(
        wrong.is_empty(),
        "the doc lists flags the jailer refuses: {wrong:?}"
    );
    let refusal = run(&["--frobnicate"]);
    let usage = refusal
        .split_once("usage:")
        .map(|(_, usage)| usage)
        .unwrap_or_else(|| panic!("no usage in {refusal:?}"));
    let taken: Vec<&str> = usage
        .split_whitespace()
        .map(|token| token.trim_start_matches('['))
        .filter_map(|token| token.split([']', '=']).next())
        .filter(|token| token.starts_with("--"))
        .collect();
    assert!(taken.len() >= 12, "{usage}");
    let missing: Vec<&&str> = taken
        .iter()
        .filter(|flag| !flags.iter().any(|f| f == *flag))
        .collect();
    assert!(
        missing.is_empty(),
        "flags missing from the doc's Jailer table: {missing:?}"
    );
}
