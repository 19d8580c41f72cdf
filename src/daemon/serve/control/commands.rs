//! The handler of each control command: arguments checked, the registry asked, the answer
//! shaped as QEMU shapes it (with our extra fields where we have more to say).

use std::path::{Path, PathBuf};

use nbd_server::CloseMode;
use serde_json::{json, Map, Value};

use super::args::{Args, Running};
use super::qmp::{ErrorClass, QmpError};
use crate::daemon::serve::registry::{ChangeError, Record, Registry};
use crate::daemon::serve::served_images::{refuse_nbd_name, ImageSpec, Origin};
use qcow2::engine::Format;

/// A handler's answer that needs no waiting.
fn ready(outcome: Result<Value, QmpError>) -> Running {
    Box::pin(std::future::ready(outcome))
}

/// A registry refusal as QEMU would class it.
fn change_error(e: ChangeError) -> QmpError {
    let class = match e {
        ChangeError::NotFound(_) => ErrorClass::DeviceNotFound,
        _ => ErrorClass::GenericError,
    };
    QmpError::new(class, e.to_string())
}

/// `qmp_capabilities`: leaves negotiation (the dispatcher keeps the phase). We offer no
/// optional capability, so `enable` may only list none.
pub fn capabilities(_: Registry, mut args: Args) -> Running {
    ready((|| {
        if let Some(enable) = args.opt_strings("enable")? {
            if let Some(c) = enable.first() {
                return Err(QmpError::generic(format!("Capability '{c}' not available")));
            }
        }
        args.finish()?;
        Ok(json!({}))
    })())
}

/// `query-commands`: every command's name.
pub fn query_commands(_: Registry, args: Args) -> Running {
    ready(
        args.finish()
            .map(|()| Value::Array(COMMANDS.iter().map(|c| json!({"name": c.name})).collect())),
    )
}

/// `query-version`: QEMU's shape, version 0.0.0, our package name.
pub fn query_version(_: Registry, args: Args) -> Running {
    ready(args.finish().map(|()| {
        json!({
            "qemu": {"micro": 0, "minor": 0, "major": 0},
            "package": concat!("qcow2-nbd ", env!("CARGO_PKG_VERSION")),
        })
    }))
}

/// `query-block-exports`: QEMU's fields, then ours.
pub fn query_block_exports(registry: Registry, args: Args) -> Running {
    ready(args.finish().map(|()| {
        registry.with_records(|records| Value::Array(records.iter().map(export_info).collect()))
    }))
}

fn export_info(r: &Record) -> Value {
    json!({
        "type": "nbd",
        "id": r.id,
        "node-name": r.id,
        "shutting-down": r.state.is_closing(),
        "name": r.spec.name,
        "file": r.spec.path.display().to_string(),
        "writable": !r.image.is_read_only(),
        "description": r.spec.description,
        "bitmaps": r.spec.bitmaps,
        "connections": r.state.attached(),
    })
}

/// `block-export-add`: opens the file with its locks and serves it.
pub fn block_export_add(registry: Registry, mut args: Args) -> Running {
    let parsed = add_arguments(&mut args).and_then(|spec| args.finish().map(|()| spec));
    Box::pin(async move {
        let (id, spec) = parsed?;
        registry.add(id, spec).await.map_err(change_error)?;
        Ok(json!({}))
    })
}

/// The export `block-export-add` asks for, checked.
fn add_arguments(args: &mut Args) -> Result<(String, ImageSpec), QmpError> {
    if let Some(kind) = args.opt_string("type")? {
        if kind != "nbd" {
            return Err(QmpError::generic(format!(
                "Export type '{kind}' is not supported: this server exports over NBD only"
            )));
        }
    }
    if args.opt_string("node-name")?.is_some() {
        return Err(QmpError::generic(
            "Parameter 'node-name' is not supported: there are no block nodes here, \
             give the image with 'file'",
        ));
    }
    let id = args.string("id")?;
    if id.is_empty() {
        return Err(QmpError::generic("Parameter 'id' must not be empty"));
    }
    let file = args.string("file")?;
    refuse_nbd_name(Path::new(&file)).map_err(|e| QmpError::generic(e.to_string()))?;
    let format = match args.opt_string("format")?.as_deref() {
        None | Some("qcow2") => None,
        Some("raw") => Some(Format::Raw),
        Some(other) => {
            return Err(QmpError::generic(format!(
                "Parameter 'format' must be qcow2 or raw, not '{other}'"
            )))
        }
    };
    let spec = ImageSpec {
        name: args.opt_string("name")?.unwrap_or_else(|| id.clone()),
        description: args.opt_string("description")?.unwrap_or_default(),
        path: PathBuf::from(file),
        read_only: !args.opt_bool("writable")?.unwrap_or(false),
        format,
        probed: false,
        bitmaps: args.opt_strings("bitmaps")?.unwrap_or_default(),
        untrusted: args.opt_bool("untrusted")?.unwrap_or(false),
        overlay: None,
        origin: Origin::Command,
    };
    Ok((id, spec))
}

/// `block-export-del`: closes the export to new clients; the image closes once the last
/// one leaves (`safe`) or once its connections are ended (`hard`).
pub fn block_export_del(registry: Registry, mut args: Args) -> Running {
    ready((|| {
        let id = args.string("id")?;
        let mode = match args.opt_string("mode")?.as_deref() {
            None | Some("safe") => CloseMode::Safe,
            Some("hard") => CloseMode::Hard,
            Some(other) => {
                return Err(QmpError::generic(format!(
                    "Parameter 'mode' does not accept value '{other}'"
                )))
            }
        };
        args.finish()?;
        registry.delete(&id, mode).map_err(change_error)?;
        Ok(json!({}))
    })())
}

/// `block-dirty-bitmap-add`.
pub fn bitmap_add(registry: Registry, mut args: Args) -> Running {
    ready((|| {
        let (node, name) = (args.string("node")?, args.string("name")?);
        let granularity = args.opt_u64("granularity")?;
        if args.opt_bool("persistent")? == Some(false) {
            return Err(QmpError::generic(
                "only persistent bitmaps are supported: bitmaps live in the qcow2 file, \
                 and this server keeps no bitmap in memory only",
            ));
        }
        let enabled = !args.opt_bool("disabled")?.unwrap_or(false);
        args.finish()?;
        with_writable(&registry, &node, |r| {
            r.image
                .add_bitmap(&name, granularity, enabled)
                .map_err(engine)
        })
    })())
}

/// `block-dirty-bitmap-remove`.
pub fn bitmap_remove(registry: Registry, mut args: Args) -> Running {
    ready((|| {
        let (node, name) = (args.string("node")?, args.string("name")?);
        args.finish()?;
        with_writable(&registry, &node, |r| {
            refuse_exported(r, &name)?;
            r.image.remove_bitmap(&name).map_err(engine)
        })
    })())
}

/// `block-dirty-bitmap-clear`.
pub fn bitmap_clear(registry: Registry, mut args: Args) -> Running {
    ready((|| {
        let (node, name) = (args.string("node")?, args.string("name")?);
        args.finish()?;
        with_writable(&registry, &node, |r| {
            refuse_exported(r, &name)?;
            r.image.clear_bitmap(&name).map_err(engine)
        })
    })())
}

/// A bitmap clients read through `qemu:dirty-bitmap:` must not vanish or lose its bits
/// under them (a backup reading it would copy too little).
fn refuse_exported(r: &Record, name: &str) -> Result<(), QmpError> {
    if r.spec.bitmaps.iter().any(|b| b == name) {
        return Err(QmpError::generic(format!(
            "Bitmap '{name}' is exported to NBD clients of export '{}'",
            r.id
        )));
    }
    Ok(())
}

fn engine(e: qcow2::engine::EngineError) -> QmpError {
    QmpError::generic(e.to_string())
}

/// Runs a bitmap change on export `node`'s image, which must be writable.
fn with_writable(
    registry: &Registry,
    node: &str,
    change: impl FnOnce(&Record) -> Result<(), QmpError>,
) -> Result<Value, QmpError> {
    let done = registry.with_record(node, |r| {
        if r.image.is_read_only() {
            return Err(QmpError::generic(format!(
                "Export '{node}' is read-only: its bitmaps cannot change"
            )));
        }
        if r.state.is_closing() {
            return Err(QmpError::generic(format!(
                "Export '{node}' is shutting down"
            )));
        }
        change(r)
    });
    match done {
        Some(result) => result.map(|()| json!({})),
        None => Err(QmpError::new(
            ErrorClass::DeviceNotFound,
            format!("Export '{node}' is not found"),
        )),
    }
}

/// `query-stats`: per export, what the server counts (`id` selects one), and the server's
/// total (which keeps what deleted exports counted) when all are asked for.
pub fn query_stats(registry: Registry, mut args: Args) -> Running {
    ready((|| {
        let only = args.opt_string("id")?;
        args.finish()?;
        let exports = registry.with_records(|records| {
            records
                .iter()
                .filter(|r| only.as_ref().is_none_or(|id| &r.id == id))
                .map(|r| Value::Object(export_stats(&registry, r)))
                .collect::<Vec<_>>()
        });
        if let (Some(id), true) = (&only, exports.is_empty()) {
            return Err(QmpError::new(
                ErrorClass::DeviceNotFound,
                format!("Export '{id}' is not found"),
            ));
        }
        let mut out = json!({ "exports": exports });
        if let (Some(stats), None) = (registry.stats(), &only) {
            out["total"] = stats.total_json();
        }
        Ok(out)
    })())
}

/// One export's statistics: the one place their fields are put together (its identity,
/// then every counter of the statistics registry, which the server keeps whenever it has a
/// control socket).
fn export_stats(registry: &Registry, r: &Record) -> Map<String, Value> {
    let mut out = Map::new();
    out.insert("id".into(), json!(r.id));
    out.insert("name".into(), json!(r.spec.name));
    let counted = registry.stats().and_then(|s| s.export_json(&r.spec.name));
    if let Some(Value::Object(fields)) = counted {
        out.extend(fields);
    }
    out
}

/// One command: its name and its handler.
pub struct Command {
    /// The name clients execute.
    pub name: &'static str,
    /// Runs it.
    pub run: fn(Registry, Args) -> Running,
}

/// Every command, in the order `query-commands` lists them.
pub const COMMANDS: &[Command] = &[
    Command {
        name: "qmp_capabilities",
        run: capabilities,
    },
    Command {
        name: "query-commands",
        run: query_commands,
    },
    Command {
        name: "query-version",
        run: query_version,
    },
    Command {
        name: "query-block-exports",
        run: query_block_exports,
    },
    Command {
        name: "block-export-add",
        run: block_export_add,
    },
    Command {
        name: "block-export-del",
        run: block_export_del,
    },
    Command {
        name: "block-dirty-bitmap-add",
        run: bitmap_add,
    },
    Command {
        name: "block-dirty-bitmap-remove",
        run: bitmap_remove,
    },
    Command {
        name: "block-dirty-bitmap-clear",
        run: bitmap_clear,
    },
    Command {
        name: "query-stats",
        run: query_stats,
    },
];

#[cfg(test)]
mod table_tests {
    use super::*;

    #[test]
    fn command_names_are_unique() {
        for (i, c) in COMMANDS.iter().enumerate() {
            assert!(
                COMMANDS[..i].iter().all(|o| o.name != c.name),
                "{} twice",
                c.name
            );
        }
    }
}
