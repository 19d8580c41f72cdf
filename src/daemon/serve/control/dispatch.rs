//! Which handler runs a command, and the capabilities negotiation before any does.

use super::args::{Args, Outcome};
use super::commands::COMMANDS;
use super::qmp::{ErrorClass, QmpError, Request};
use crate::daemon::serve::registry::Registry;

/// Where a session stands on capabilities negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Only `qmp_capabilities` is accepted.
    Negotiating,
    /// Commands run.
    Ready,
}

/// Runs one request in `phase`: the reply's result, and the phase after it.
pub async fn dispatch(registry: &Registry, phase: Phase, request: Request) -> (Outcome, Phase) {
    let capabilities = request.execute == "qmp_capabilities";
    match (phase, capabilities) {
        (Phase::Negotiating, false) => {
            return (
                Err(QmpError::new(
                    ErrorClass::CommandNotFound,
                    "Expecting capabilities negotiation with 'qmp_capabilities'",
                )),
                phase,
            )
        }
        (Phase::Ready, true) => {
            return (
                Err(QmpError::new(
                    ErrorClass::CommandNotFound,
                    "Capabilities negotiation is already complete, command ignored",
                )),
                phase,
            )
        }
        _ => {}
    }
    let Some(command) = COMMANDS.iter().find(|c| c.name == request.execute) else {
        let desc = format!("The command {} has not been found", request.execute);
        return (Err(QmpError::new(ErrorClass::CommandNotFound, desc)), phase);
    };
    let outcome = (command.run)(registry.clone(), Args(request.arguments)).await;
    let next = if capabilities && outcome.is_ok() {
        Phase::Ready
    } else {
        phase
    };
    (outcome, next)
}
