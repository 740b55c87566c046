//! The documentation stays in step with the code.
//!
//! docs/firecracker-compat.md and docs/cloud-hypervisor-compat.md: every route their tables
//! list is sent to a live gpuvm in that mode. A route the doc calls supported must be known
//! to the front end (not "no such route", not "method not allowed", not a "not supported"
//! refusal); one it calls not supported must be refused with 400 and the message the doc
//! quotes. A front end that learns a route, or drops one, fails here until the doc says so.
//!
//! The README and docs/: every gpuvm command their shell blocks show is one the binary takes
//! (a real subcommand, flags its `--help` lists), docs/cli.md lists every flag, docs/api.md's
//! route table matches api/src/routes.rs, api/openapi.json and a live gpuvm, docs/testing.md
//! lists every real-kernel scenario, every relative link resolves, and the README's test
//! command is the one `.ci/run` runs.

use std::path::{Path, PathBuf};

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

// ---- The README and docs/ against the code ----

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A file of the repository, by its path from the root.
fn repo_file(path: &str) -> String {
    let full = repo().join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{}: {e}", full.display()))
}

/// The Markdown pages the checks below read, by their paths from the root.
fn pages() -> Vec<String> {
    let mut pages: Vec<String> = ["README.md", "ARCHITECTURE.md", "guest-images/README.md"]
        .map(String::from)
        .to_vec();
    let mut docs: Vec<String> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// `text` without its fenced code blocks (their lines become empty).
fn prose(text: &str) -> String {
    let mut fenced = false;
    text.lines()
        .map(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return "";
            }
            if fenced {
                ""
            } else {
                line
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The logical lines of `text`'s shell code blocks (```sh, ```bash, ```shell): backslash
/// continuations joined, here-document bodies left out.
fn shell_lines(text: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut in_shell = false;
    let mut fenced = false;
    let mut pending = String::new();
    let mut heredoc: Option<String> = None;
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed.strip_prefix("```") {
            fenced = !fenced;
            in_shell = fenced && matches!(info.trim(), "sh" | "bash" | "shell");
            continue;
        }
        if !in_shell {
            continue;
        }
        if let Some(end) = &heredoc {
            if trimmed.trim() == end {
                heredoc = None;
            }
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(line);
        let logical = std::mem::take(&mut pending);
        if let Some((_, rest)) = logical.split_once("<<") {
            let delimiter = rest.trim_start_matches('-').split_whitespace().next();
            heredoc = delimiter.map(|d| d.trim_matches(['\'', '"']).to_string());
        }
        lines.push(logical.trim().to_string());
    }
    lines
}

/// The inline code spans of `text`'s prose that are commands of this repository: they
/// start with `gpuvm `, `scripts/` or `bench/`.
fn inline_commands(text: &str) -> Vec<String> {
    prose(text)
        .lines()
        .flat_map(|line| {
            backticked(line)
                .into_iter()
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|span| {
            ["gpuvm ", "scripts/", "bench/"]
                .iter()
                .any(|p| span.starts_with(p))
        })
        .collect()
}

/// Splits a shell line into its simple commands' words: quotes removed, redirections and
/// their targets dropped, separated at `|`, `||`, `&&`, `;` and `&`, up to a comment.
fn shell_commands(line: &str) -> Vec<Vec<String>> {
    struct Words {
        commands: Vec<Vec<String>>,
        word: String,
        started: bool,
        redirect: bool,
    }
    impl Words {
        fn end_word(&mut self) {
            if self.started {
                let word = std::mem::take(&mut self.word);
                if self.redirect {
                    self.redirect = false;
                } else {
                    self.commands.last_mut().unwrap().push(word);
                }
                self.started = false;
            }
        }
        fn end_command(&mut self) {
            self.end_word();
            self.redirect = false;
            if !self.commands.last().unwrap().is_empty() {
                self.commands.push(Vec::new());
            }
        }
    }
    let mut w = Words {
        commands: vec![Vec::new()],
        word: String::new(),
        started: false,
        redirect: false,
    };
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                w.started = true;
                for c in chars.by_ref() {
                    if c == '\'' {
                        break;
                    }
                    w.word.push(c);
                }
            }
            '"' => {
                w.started = true;
                while let Some(c) = chars.next() {
                    match c {
                        '"' => break,
                        '\\' => w.word.extend(chars.next()),
                        _ => w.word.push(c),
                    }
                }
            }
            '\\' => {
                w.started = true;
                w.word.extend(chars.next());
            }
            ' ' | '\t' => w.end_word(),
            '#' if !w.started => break,
            '|' | ';' | '&' => {
                w.end_command();
                while matches!(chars.peek(), Some('|' | '&')) {
                    chars.next();
                }
            }
            '>' | '<' => {
                // A descriptor number before the operator belongs to the redirection.
                if w.started && w.word.chars().all(|c| c.is_ascii_digit()) {
                    w.word.clear();
                    w.started = false;
                } else {
                    w.end_word();
                }
                while matches!(chars.peek(), Some('>' | '<' | '&')) {
                    chars.next();
                }
                w.redirect = true;
            }
            _ => {
                w.started = true;
                w.word.push(c);
            }
        }
    }
    w.end_word();
    w.commands.retain(|command| !command.is_empty());
    w.commands
}

/// What a value-taking flag expects after it.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Value {
    None,
    Required,
    Optional,
}

/// What `gpuvm ... --help` lists: long flags, short ones, and subcommands.
#[derive(Debug, Default)]
struct Help {
    flags: Vec<(String, Value)>,
    shorts: Vec<(String, String)>,
    commands: Vec<String>,
}

impl Help {
    fn flag(&self, name: &str) -> Option<Value> {
        let long = self
            .shorts
            .iter()
            .find(|(short, _)| short == name)
            .map_or(name, |(_, long)| long.as_str());
        self.flags
            .iter()
            .find(|(flag, _)| flag == long)
            .map(|(_, value)| *value)
    }

    /// The long flags, without the global ones and --help/--version.
    fn own_flags(&self) -> Vec<String> {
        const GLOBAL: [&str; 4] = ["--log-format", "--log-level", "--help", "--version"];
        let mut flags: Vec<String> = self
            .flags
            .iter()
            .map(|(flag, _)| flag.clone())
            .filter(|flag| !GLOBAL.contains(&flag.as_str()))
            .collect();
        flags.sort();
        flags
    }
}

/// Parses clap's help text.
fn parse_help(text: &str) -> Help {
    let mut help = Help::default();
    let mut section = "";
    for line in text.lines() {
        let trimmed = line.trim();
        if !line.starts_with(' ') && trimmed.ends_with(':') {
            section = trimmed;
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        if trimmed.is_empty() || indent > 6 {
            continue;
        }
        match section {
            "Commands:" => help
                .commands
                .extend(trimmed.split_whitespace().next().map(String::from)),
            "Options:" if trimmed.starts_with('-') => {
                let tokens: Vec<&str> = trimmed.split_whitespace().collect();
                let mut short = None;
                for (i, token) in tokens.iter().enumerate() {
                    let token = token.trim_end_matches(',');
                    if token.starts_with("--") {
                        let value = match tokens.get(i + 1) {
                            Some(next) if next.starts_with('<') => Value::Required,
                            Some(next) if next.starts_with("[<") => Value::Optional,
                            _ => Value::None,
                        };
                        help.flags.push((token.to_string(), value));
                        if let Some(short) = short {
                            help.shorts.push((short, token.to_string()));
                        }
                        break;
                    }
                    short = Some(token.to_string());
                }
            }
            _ => {}
        }
    }
    help
}

/// `gpuvm <path> --help`, parsed (each path asked once).
fn help_of<'a>(cache: &'a mut Vec<(Vec<String>, Help)>, path: &[String]) -> &'a Help {
    if let Some(i) = cache.iter().position(|(p, _)| p == path) {
        return &cache[i].1;
    }
    let out = std::process::Command::new(gpuvm_bin())
        .args(path)
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gpuvm {} --help: {:?} {text}",
        path.join(" "),
        out.status
    );
    cache.push((path.to_vec(), parse_help(&text)));
    &cache.last().unwrap().1
}

/// Checks `args` (what follows `gpuvm`) against the binary's help: a real subcommand, and
/// only flags that subcommand lists.
fn check_gpuvm_args(args: &[String], cache: &mut Vec<(Vec<String>, Help)>) -> Result<(), String> {
    let mut path: Vec<String> = Vec::new();
    let mut args = args
        .iter()
        .map(|arg| arg.trim_start_matches('[').trim_end_matches(']'))
        .filter(|arg| !arg.is_empty() && *arg != "...")
        .peekable();
    while let Some(arg) = args.next() {
        let help = help_of(cache, &path);
        if arg.starts_with('-') && arg.len() > 1 {
            let (name, inline) = match arg.split_once('=') {
                Some((name, _)) => (name, true),
                None => (arg, false),
            };
            match help.flag(name) {
                None => {
                    return Err(format!(
                        "`gpuvm {}` has no {name} (its --help lists {:?})",
                        path.join(" "),
                        help.flags.iter().map(|(f, _)| f).collect::<Vec<_>>()
                    ))
                }
                Some(Value::Required) if !inline => {
                    args.next();
                }
                Some(Value::Optional) if !inline => {
                    args.next_if(|next| !next.starts_with('-'));
                }
                _ => {}
            }
        } else if !help.commands.is_empty() {
            // An upper-case word stands for arguments (`scripts/gpuvm ARGS`).
            if arg.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
                break;
            }
            if !help.commands.iter().any(|c| c == arg) {
                return Err(format!(
                    "`gpuvm {}` has no subcommand {arg} (it has {:?})",
                    path.join(" "),
                    help.commands
                ));
            }
            path.push(arg.to_string());
        }
    }
    Ok(())
}

/// The words after `gpuvm` that select a peer's front end, and the program names that do.
const PEER_SELECTORS: [&str; 5] = ["ch", "--ch-compat", "firecracker", "--fc-compat", "jailer"];
const PEER_PROGRAMS: [&str; 3] = ["cloud-hypervisor", "firecracker", "jailer"];

/// The flags a peer's front end takes, from its refusal of an unknown one (Cloud
/// Hypervisor's and Firecracker's list them, the jailer prints its usage). `how` is a
/// program name (run through a symlink of that name) or a selector word after `gpuvm`.
fn peer_flags(how: &str, scratch: &Scratch) -> Vec<String> {
    let mut command = if PEER_SELECTORS.contains(&how) {
        let mut command = std::process::Command::new(gpuvm_bin());
        command.arg(how);
        command
    } else {
        let link = scratch.path(how);
        if !link.exists() {
            std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
        }
        std::process::Command::new(link)
    };
    let out = command.arg("--frobnicate").output().unwrap();
    let refusal = String::from_utf8_lossy(&out.stderr).into_owned();
    if let Some((_, rest)) = refusal.split_once("(it takes ") {
        let list = rest.split_once(')').map_or(rest, |(list, _)| list);
        return list.split(", ").map(String::from).collect();
    }
    let usage = refusal
        .split_once("usage:")
        .map(|(_, usage)| usage)
        .unwrap_or_else(|| panic!("{how}: no list of flags in {refusal:?}"));
    usage
        .split_whitespace()
        .map(|token| token.trim_start_matches('['))
        .filter_map(|token| token.split([']', '=']).next())
        .filter(|token| token.starts_with('-'))
        .map(String::from)
        .collect()
}

/// The flags in `args` that a peer front end (`how`, as for [`peer_flags`]) does not take.
fn unknown_peer_flags(
    how: &str,
    args: &[String],
    peers: &mut Vec<(String, Vec<String>)>,
    scratch: &Scratch,
) -> Option<String> {
    if !peers.iter().any(|(p, _)| p == how) {
        peers.push((how.to_string(), peer_flags(how, scratch)));
    }
    let taken = &peers.iter().find(|(p, _)| p == how).unwrap().1;
    let unknown: Vec<&String> = args
        .iter()
        .filter(|arg| arg.starts_with('-') && arg.as_str() != "--")
        .filter(|arg| {
            !taken
                .iter()
                .any(|t| Some(t.as_str()) == arg.split('=').next())
        })
        .collect();
    (!unknown.is_empty()).then(|| format!("the {how} front end does not take {unknown:?}"))
}

/// Every shell command the README and the docs show that runs gpuvm (`gpuvm`,
/// `scripts/gpuvm`, or gpuvm under a peer's name), a script or a benchmark of this
/// repository, is one the code takes: a subcommand and flags that `--help` lists, a peer
/// flag the front end takes, a file that exists, a benchmark flag the script parses.
#[test]
fn the_commands_in_the_readme_and_docs_are_real() {
    let scratch = Scratch::new("compat-docs", "commands");
    let mut cache = Vec::new();
    let mut peers: Vec<(String, Vec<String>)> = Vec::new();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for page in pages() {
        let text = repo_file(&page);
        let mut lines = shell_lines(&text);
        lines.extend(inline_commands(&text));
        for line in lines {
            for command in shell_commands(&line) {
                let program = command[0].as_str();
                let name = program.rsplit('/').next().unwrap_or(program);
                let args = &command[1..];
                let problem = if name == "gpuvm" {
                    match args.first() {
                        Some(word) if PEER_SELECTORS.contains(&word.as_str()) => {
                            unknown_peer_flags(word, &args[1..], &mut peers, &scratch)
                        }
                        _ => check_gpuvm_args(args, &mut cache).err(),
                    }
                } else if ["scripts/", "bench/", "tests/", "guest-images/", ".ci/"]
                    .iter()
                    .any(|dir| program.starts_with(dir))
                {
                    match std::fs::read_to_string(repo().join(program)) {
                        Err(e) => Some(format!("{program}: {e}")),
                        Ok(script) if program.starts_with("bench/") => {
                            let unknown: Vec<&str> = args
                                .iter()
                                .map(|arg| arg.trim_start_matches('['))
                                .filter(|arg| arg.starts_with('-'))
                                .filter_map(|arg| arg.split(['=', ']']).next())
                                .filter(|flag| !script.contains(&format!("\"{flag}\"")))
                                .collect();
                            (!unknown.is_empty())
                                .then(|| format!("{program} does not parse {unknown:?}"))
                        }
                        Ok(_) => None,
                    }
                } else if PEER_PROGRAMS.contains(&name) {
                    unknown_peer_flags(name, args, &mut peers, &scratch)
                } else {
                    continue;
                };
                checked += 1;
                if let Some(problem) = problem {
                    wrong.push(format!("{page}: `{line}`: {problem}"));
                }
            }
        }
    }
    assert!(checked >= 40, "only {checked} commands checked");
    assert!(
        wrong.is_empty(),
        "commands the code does not take:\n{}",
        wrong.join("\n")
    );
}

/// The headings' anchors of a Markdown page, as GitHub makes them.
fn anchors(text: &str) -> Vec<String> {
    prose(text)
        .lines()
        .filter(|line| line.starts_with('#'))
        .map(|line| {
            line.trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect()
}

/// Every relative link of the README, ARCHITECTURE.md, guest-images/README.md and docs/*.md
/// names a file that exists, and its `#anchor` a heading of that file; every `docs/NAME.md`
/// they mention in text exists.
#[test]
fn relative_links_in_the_readme_and_docs_resolve() {
    let mut wrong = Vec::new();
    let mut links = 0;
    for page in pages() {
        let text = repo_file(&page);
        let dir = Path::new(&page).parent().unwrap().to_path_buf();
        let prose = prose(&text);
        for (_, rest) in prose
            .match_indices("](")
            .map(|(i, _)| prose.split_at(i + 2))
        {
            let Some(target) = rest.split(')').next() else {
                continue;
            };
            if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            links += 1;
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file = if file.is_empty() {
                PathBuf::from(&page)
            } else {
                dir.join(file)
            };
            let full = repo().join(&file);
            if !full.exists() {
                wrong.push(format!("{page}: ({target}): no {}", file.display()));
                continue;
            }
            if !anchor.is_empty() {
                let target_text = std::fs::read_to_string(&full).unwrap_or_default();
                if !anchors(&target_text).iter().any(|a| a == anchor) {
                    wrong.push(format!(
                        "{page}: ({target}): no heading #{anchor} in {}",
                        file.display()
                    ));
                }
            }
        }
        for (i, _) in text.match_indices("docs/") {
            let name: String = text[i + 5..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                .collect();
            let Some((stem, _)) = name.split_once(".md") else {
                continue;
            };
            if !repo().join("docs").join(format!("{stem}.md")).exists() {
                wrong.push(format!(
                    "{page}: mentions docs/{stem}.md, which does not exist"
                ));
            }
        }
    }
    assert!(links >= 50, "only {links} links found");
    assert!(wrong.is_empty(), "broken links:\n{}", wrong.join("\n"));
}

/// The README's test command is the one CI runs: its "The two commands" block holds
/// `scripts/test.sh`, and `.ci/run` execs exactly that.
#[test]
fn the_readme_test_command_is_what_ci_runs() {
    let readme = repo_file("README.md");
    let section = readme
        .split_once("\n## The two commands\n")
        .and_then(|(_, rest)| rest.split("\n## ").next())
        .expect("a \"The two commands\" section in README.md");
    let commands: Vec<Vec<String>> = shell_lines(section)
        .iter()
        .flat_map(|line| shell_commands(line))
        .collect();
    assert_eq!(
        commands,
        [
            vec!["scripts/gpuvm".to_string(), "run".to_string()],
            vec!["scripts/test.sh".to_string()]
        ],
        "README.md's two commands"
    );
    let ci = repo_file(".ci/run");
    let exec: Vec<&str> = ci
        .lines()
        .filter(|l| l.trim_start().starts_with("exec "))
        .collect();
    assert_eq!(
        exec,
        ["exec scripts/test.sh"],
        ".ci/run must exec the README's test command"
    );
}

/// docs/api.md's route table, api/src/routes.rs and api/openapi.json list the same routes,
/// and a live gpuvm knows each route of the table (not 404 "no such route", not 405) and
/// answers 405 to the methods the table leaves out on those paths.
#[test]
fn the_api_doc_route_table_matches_the_routes_and_the_openapi_description() {
    let doc_rows = rows(&repo_file("docs/api.md"), "");
    assert!(
        doc_rows.len() >= 20,
        "only {} routes parsed",
        doc_rows.len()
    );
    let normal = |path: &str| {
        path.split('/')
            .map(|part| if part.starts_with('{') { "id0" } else { part })
            .collect::<Vec<_>>()
            .join("/")
    };
    let mut from_doc: Vec<(String, String)> = doc_rows
        .iter()
        .map(|r| (r.method.clone(), r.path.clone()))
        .collect();
    from_doc.sort();
    from_doc.dedup();

    let spec: serde_json::Value = serde_json::from_str(&repo_file("api/openapi.json")).unwrap();
    let mut from_spec: Vec<(String, String)> = Vec::new();
    for (path, operations) in spec["paths"].as_object().expect("paths") {
        for method in operations.as_object().unwrap().keys() {
            if METHODS.contains(&method.to_uppercase().as_str()) {
                from_spec.push((method.to_uppercase(), normal(path)));
            }
        }
    }
    from_spec.sort();
    let only_doc: Vec<_> = from_doc.iter().filter(|r| !from_spec.contains(r)).collect();
    let only_spec: Vec<_> = from_spec.iter().filter(|r| !from_doc.contains(r)).collect();
    assert!(
        only_doc.is_empty() && only_spec.is_empty(),
        "docs/api.md and api/openapi.json disagree:\nonly in the doc: {only_doc:?}\nonly in the description: {only_spec:?}"
    );

    // The paths api/src/routes.rs matches: `"/path" =>` arms and `starts_with("/prefix/")`.
    let source = repo_file("api/src/routes.rs");
    let source = source.split("#[cfg(test)]").next().unwrap();
    let mut from_code: Vec<String> = Vec::new();
    for line in source.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("\"/") {
            if let Some((path, _)) = rest.split_once("\" =>") {
                from_code.push(format!("/{path}"));
            }
        }
        if let Some((_, rest)) = line.split_once("path.starts_with(\"") {
            if let Some((prefix, _)) = rest.split_once('"') {
                from_code.push(format!("{prefix}id0"));
            }
        }
    }
    from_code.sort();
    from_code.dedup();
    let mut doc_paths: Vec<String> = from_doc.iter().map(|(_, p)| p.clone()).collect();
    doc_paths.sort();
    doc_paths.dedup();
    assert_eq!(
        doc_paths, from_code,
        "docs/api.md's paths and api/src/routes.rs's"
    );

    let scratch = Scratch::new("compat-docs", "api");
    let api = scratch.path("gpuvm.sock");
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let mut wrong = check(&api, &doc_rows);
    for path in &doc_paths {
        for method in METHODS {
            if from_doc.contains(&(method.to_string(), path.clone())) {
                continue;
            }
            let body = (method != "GET").then_some("{}");
            let response = gpuvm_api::client::request(&api, method, path, body)
                .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
            if response.status != 405 {
                wrong.push(format!(
                    "{method} {path}: not in docs/api.md, gpuvm answers {} {}",
                    response.status, response.body
                ));
            }
        }
    }
    drop(vmm);
    assert!(
        wrong.is_empty(),
        "docs/api.md is out of step with gpuvm:\n{}",
        wrong.join("\n")
    );
}

/// The flags (and, for `ctl`, subcommands) in a section of docs/cli.md's tables.
fn cli_doc_sections(doc: &str) -> Vec<(String, Vec<String>)> {
    let mut sections = Vec::new();
    for section in doc.split("\n## ").skip(1) {
        let (heading, body) = section.split_once('\n').unwrap_or((section, ""));
        let name = heading.trim().trim_matches('`').to_string();
        let cells: Vec<String> = body
            .lines()
            .filter(|line| line.starts_with("| `"))
            .filter_map(|line| line.split(" | ").next())
            .flat_map(backticked)
            .map(String::from)
            .collect();
        sections.push((name, cells));
    }
    sections
}

/// The flags a docs/cli.md cell names (`--memory SIZE`, `[--no-thp]`, `-o FILE`).
fn cell_flags(cell: &str) -> Vec<String> {
    cell.split_whitespace()
        .map(|token| token.trim_start_matches('[').trim_end_matches(']'))
        .filter(|token| token.starts_with('-'))
        .map(|token| token.split('=').next().unwrap().to_string())
        .collect()
}

/// docs/cli.md lists every flag of every subcommand, and only those: its global table
/// against `gpuvm --help`, each `gpuvm X` section against `gpuvm X --help`, and the `ctl`
/// section's subcommands (and their flags) against `gpuvm ctl [SUB] --help`.
#[test]
fn the_cli_doc_lists_every_flag_of_every_subcommand() {
    let doc = repo_file("docs/cli.md");
    let mut cache = Vec::new();
    let top = help_of(&mut cache, &[]);
    let subcommands: Vec<String> = top
        .commands
        .iter()
        .filter(|c| *c != "help")
        .cloned()
        .collect();
    let global: Vec<String> = top.flags.iter().map(|(f, _)| f.clone()).collect();
    let mut wrong = Vec::new();
    let mut documented = Vec::new();
    for (name, cells) in cli_doc_sections(&doc) {
        let path: Vec<String> = match name.strip_prefix("gpuvm ") {
            Some(sub) => vec![sub.to_string()],
            None if name == "Global flags" => Vec::new(),
            None => continue,
        };
        documented.extend(path.first().cloned());
        let help = help_of(&mut cache, &path);
        let mut listed: Vec<String> = cells
            .iter()
            .filter(|cell| cell.starts_with('-'))
            .flat_map(|cell| cell_flags(cell))
            .filter_map(|flag| match help.flag(&flag) {
                Some(_) => help
                    .shorts
                    .iter()
                    .find(|(s, _)| *s == flag)
                    .map_or(Some(flag), |(_, l)| Some(l.clone())),
                None => {
                    wrong.push(format!("{name}: {flag} is not in its --help"));
                    None
                }
            })
            .collect();
        listed.sort();
        listed.dedup();
        let expected: Vec<String> = if path.is_empty() {
            let mut all = global.clone();
            all.sort();
            all
        } else {
            help.own_flags()
        };
        let listed: Vec<String> = listed
            .into_iter()
            .filter(|flag| path.is_empty() || !global.contains(flag))
            .collect();
        for flag in expected.iter().filter(|f| !listed.contains(f)) {
            wrong.push(format!("{name}: {flag} is missing from docs/cli.md"));
        }
        if path.first().map(String::as_str) == Some("ctl") {
            let ctl = help_of(&mut cache, &path);
            let ctl_commands: Vec<String> = ctl
                .commands
                .iter()
                .filter(|c| *c != "help")
                .cloned()
                .collect();
            let mut seen = Vec::new();
            for cell in cells.iter().filter(|cell| !cell.starts_with('-')) {
                let sub = cell
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string();
                if !ctl_commands.contains(&sub) {
                    wrong.push(format!("ctl: no subcommand {sub}"));
                    continue;
                }
                let sub_path = vec!["ctl".to_string(), sub.clone()];
                let sub_help = help_of(&mut cache, &sub_path);
                let mut flags = cell_flags(cell);
                flags.sort();
                flags.dedup();
                if flags != sub_help.own_flags() {
                    wrong.push(format!(
                        "ctl {sub}: docs/cli.md lists {flags:?}, its --help {:?}",
                        sub_help.own_flags()
                    ));
                }
                seen.push(sub);
            }
            for sub in ctl_commands.iter().filter(|c| !seen.contains(c)) {
                wrong.push(format!("ctl {sub} is missing from docs/cli.md"));
            }
        }
    }
    for sub in subcommands.iter().filter(|s| !documented.contains(s)) {
        wrong.push(format!("gpuvm {sub} has no section in docs/cli.md"));
    }
    assert!(
        wrong.is_empty(),
        "docs/cli.md is out of step with gpuvm:\n{}",
        wrong.join("\n")
    );
}

/// docs/testing.md's scenario table names every real-kernel scenario, and only those.
#[test]
fn the_testing_doc_lists_every_real_kernel_scenario() {
    let doc = repo_file("docs/testing.md");
    let section = doc
        .split_once("\n## The real-kernel tier\n")
        .map(|(_, rest)| rest)
        .expect("a \"The real-kernel tier\" section");
    let mut listed: Vec<String> = section
        .lines()
        .filter(|line| line.starts_with("| `"))
        .filter_map(|line| line.split(" | ").next())
        .filter_map(|cell| backticked(cell).first().map(|s| s.to_string()))
        .collect();
    listed.sort();
    let mut scenarios: Vec<String> = std::fs::read_dir(repo().join("tests/real-kernel/scenarios"))
        .unwrap()
        .filter_map(|e| {
            e.unwrap()
                .file_name()
                .to_string_lossy()
                .strip_suffix(".sh")
                .map(String::from)
        })
        .collect();
    scenarios.sort();
    assert_eq!(
        listed, scenarios,
        "docs/testing.md's scenarios and tests/real-kernel/scenarios/"
    );
}

#[test]
fn shell_lines_and_help_are_parsed() {
    let block = "```sh\ngpuvm run --memory 1G \\\n    --cmdline \"memtest 512M 7\"   # a comment\n\
                 cat <<'EOF' > f\ngpuvm nothing\nEOF\nx=1; scripts/gpuvm ctl --api-sock s raw PUT / '{}' 2>&1 | tee out &\n```\n\
                 ```text\ngpuvm not-shell\n```\n";
    let lines = shell_lines(block);
    let commands: Vec<Vec<String>> = lines.iter().flat_map(|l| shell_commands(l)).collect();
    let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        commands,
        [
            words(&[
                "gpuvm",
                "run",
                "--memory",
                "1G",
                "--cmdline",
                "memtest 512M 7"
            ]),
            words(&["cat"]),
            words(&["x=1"]),
            words(&[
                "scripts/gpuvm",
                "ctl",
                "--api-sock",
                "s",
                "raw",
                "PUT",
                "/",
                "{}"
            ]),
            words(&["tee", "out"]),
        ]
    );
    let help = parse_help(
        "Usage: gpuvm run [OPTIONS]\n\nOptions:\n      --kernel <KERNEL>\n          Kernel: to boot\n\
         \x20 -o, --output <OUTPUT>  Where\n      --rng [<KEY=VALUE,...>]\n      --prefault\n  -h, --help\n",
    );
    assert_eq!(help.flag("--kernel"), Some(Value::Required));
    assert_eq!(help.flag("-o"), Some(Value::Required));
    assert_eq!(help.flag("--rng"), Some(Value::Optional));
    assert_eq!(help.flag("--prefault"), Some(Value::None));
    assert_eq!(help.flag("--frobnicate"), None);
    assert_eq!(
        help.own_flags(),
        ["--kernel", "--output", "--prefault", "--rng"]
    );
    assert_eq!(
        anchors("# A\n## `gpuvm run`\n```\n# not a heading\n```\n### Pause, resume and a stalled handler\n"),
        ["a", "gpuvm-run", "pause-resume-and-a-stalled-handler"]
    );
}
