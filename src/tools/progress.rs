//! A progress bar for long jobs (`convert`, `amend`). Shown when stderr is a terminal, or always with
//! `-p` as in qemu-img, never with `-q`; redrawn in place with `\r` only when the shown value
//! changes, so a forced bar into a log file stays small.
//!
//! Invoked as `qemu-img`, `convert -p` prints qemu-img's own lines instead, where scripts
//! that parse them expect them: `    (xx.xx/100%)` and a carriage return on stdout, each time
//! the value moves by more than a point, at 0 and at 100 (twice at the end), then a newline.

use std::cell::{Cell, RefCell};
use std::io::{IsTerminal, Write};

/// Width of the bar in characters.
const BAR_WIDTH: u64 = 40;

/// Whether to show progress: forced by `-p`, suppressed by `-q`, else only on a terminal.
pub fn wanted(force: bool, quiet: bool) -> bool {
    !quiet && (force || std::io::stderr().is_terminal())
}

/// A progress bar over `total` units of work, written to `out`.
pub struct Progress<W: Write> {
    total: u64,
    done: Cell<u64>,
    /// Last value drawn, in hundredths of a percent (`None` before the first draw).
    shown: Cell<Option<u64>>,
    out: RefCell<Option<W>>,
    /// qemu-img's lines instead of the bar: the percentage last printed.
    qemu: Option<Cell<f32>>,
}

impl Progress<Box<dyn Write>> {
    /// Progress as the name the binary was invoked by shows it: qemu-img's lines on stdout,
    /// only when asked for (`-p`, unless `-q`); else the bar on stderr ([`wanted`]).
    pub fn for_tool(total: u64, force: bool, quiet: bool) -> Self {
        if crate::common::prog::current() == crate::common::prog::Personality::QemuImg {
            let out: Option<Box<dyn Write>> =
                (force && !quiet).then(|| Box::new(std::io::stdout()) as Box<dyn Write>);
            let p = Progress {
                total,
                done: Cell::new(0),
                shown: Cell::new(None),
                out: RefCell::new(out),
                qemu: Some(Cell::new(0.0)),
            };
            p.print_qemu(0.0);
            return p;
        }
        let out = wanted(force, quiet).then(|| Box::new(std::io::stderr()) as Box<dyn Write>);
        Progress::new(total, out)
    }
}

impl Progress<std::io::Stderr> {
    /// A bar on stderr, or a silent counter when `show` is false.
    pub fn stderr(total: u64, show: bool) -> Self {
        Progress::new(total, show.then(std::io::stderr))
    }
}

impl<W: Write> Progress<W> {
    /// A bar writing to `out` (`None`: count silently).
    pub fn new(total: u64, out: Option<W>) -> Self {
        let p = Progress {
            total,
            done: Cell::new(0),
            shown: Cell::new(None),
            out: RefCell::new(out),
            qemu: None,
        };
        p.draw();
        p
    }

    /// Records `n` more units done.
    pub fn advance(&self, n: u64) {
        self.done
            .set(self.done.get().saturating_add(n).min(self.total));
        self.draw();
    }

    /// Sets the units done to `done` (which may go back, as an amend's projected total
    /// can grow).
    pub fn set(&self, done: u64) {
        self.done.set(done.min(self.total));
        self.draw();
    }

    /// Draws the final state and ends the line.
    pub fn finish(&self) {
        if self.qemu.is_some() {
            self.print_qemu(100.0);
            if let Some(out) = self.out.borrow_mut().as_mut() {
                let _ = writeln!(out);
                let _ = out.flush();
            }
            return;
        }
        self.draw();
        if let Some(out) = self.out.borrow_mut().as_mut() {
            // Progress is a courtesy: a closed stderr must not fail the copy.
            let _ = writeln!(out);
            let _ = out.flush();
        }
    }

    /// Hundredths of a percent done (100% for an empty job).
    fn hundredths(&self) -> u64 {
        if self.total == 0 {
            return 10_000;
        }
        // u128: done * 10_000 can exceed u64 for disks over 1.8 EB.
        let h = u128::from(self.done.get()) * 10_000 / u128::from(self.total);
        u64::try_from(h).unwrap_or(10_000)
    }

    /// qemu-img's line for `current` percent, if it moved by more than a point since the
    /// last one or is 0 or 100.
    fn print_qemu(&self, current: f32) {
        let Some(last) = &self.qemu else {
            return;
        };
        let moved = current > last.get() + 1.0 || current < last.get() - 1.0;
        if !(moved || current == 0.0 || current == 100.0) {
            return;
        }
        last.set(current);
        if let Some(out) = self.out.borrow_mut().as_mut() {
            let _ = write!(out, "    ({current:.2}/100%)\r");
            let _ = out.flush();
        }
    }

    fn draw(&self) {
        if self.qemu.is_some() {
            let current = match self.total {
                0 => 100.0,
                t => (100.0 * self.done.get() as f64 / t as f64) as f32,
            };
            return self.print_qemu(current);
        }
        let h = self.hundredths();
        if self.shown.get() == Some(h) {
            return;
        }
        if let Some(out) = self.out.borrow_mut().as_mut() {
            self.shown.set(Some(h));
            let _ = write!(out, "\r{}", render(h));
            let _ = out.flush();
        }
    }
}

/// One frame: a bar and qemu-img's `(xx.xx/100%)`.
pub fn render(hundredths: u64) -> String {
    let h = hundredths.min(10_000);
    let filled = h * BAR_WIDTH / 10_000;
    let bar: String = (0..BAR_WIDTH)
        .map(|i| if i < filled { '#' } else { '.' })
        .collect();
    format!("[{bar}]    ({}.{:02}/100%)", h / 100, h % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames() {
        assert_eq!(render(0), format!("[{}]    (0.00/100%)", ".".repeat(40)));
        assert_eq!(
            render(5_025),
            format!("[{}{}]    (50.25/100%)", "#".repeat(20), ".".repeat(20))
        );
        assert_eq!(
            render(10_000),
            format!("[{}]    (100.00/100%)", "#".repeat(40))
        );
    }

    #[test]
    fn redraws_only_on_change_and_ends_the_line() {
        let p = Progress::new(1000, Some(Vec::new()));
        p.advance(0);
        p.advance(500);
        p.advance(0);
        p.advance(10_000); // clamped to the total
        p.finish();
        let out = String::from_utf8(p.out.into_inner().unwrap()).unwrap();
        let frames: Vec<&str> = out.split('\r').filter(|s| !s.is_empty()).collect();
        assert_eq!(frames.len(), 3, "{out:?}");
        assert!(frames[0].ends_with("(0.00/100%)"));
        assert!(frames[1].ends_with("(50.00/100%)"));
        assert!(frames[2].ends_with("(100.00/100%)\n"));
        assert_eq!(p.done.get(), 1000);
    }

    #[test]
    fn silent_progress_counts_and_empty_jobs_are_complete() {
        let p: Progress<Vec<u8>> = Progress::new(0, None);
        assert_eq!(p.hundredths(), 10_000);
        let p: Progress<Vec<u8>> = Progress::new(10, None);
        p.advance(3);
        assert_eq!(p.done.get(), 3);
        assert_eq!(p.hundredths(), 3000);
    }

    #[test]
    fn quiet_wins_over_force() {
        assert!(!wanted(true, true));
        assert!(wanted(true, false));
    }
}
