//! Event format texts, as tracefs shows them in `events/*/*/format`, and
//! the layouts they describe: the four common fields, then the event's own,
//! each with its C type, offset, size and sign, and a `print fmt` line that
//! libtraceevent evaluates to print the event.
//!
//! The layouts are the kernel's: `ftrace/function` and the function graph
//! events from `kernel/trace/trace_entries.h` (the exit event in the form
//! with `retval`), the kprobe events as `trace_kprobe.c` and
//! `trace_probe.c` define them (a `__probe_ip`, or `__probe_func` and
//! `__probe_ret_ip` for return probes, then each fetch argument packed in
//! order, strings as `__data_loc char[]`), and `sched/sched_switch` and
//! `sched/sched_wakeup` from `include/trace/events/sched.h`.

use std::fmt::Write as _;

use tracelang::kprobe::{ArgType, IntType};

/// Bytes of the common fields (type, flags, preempt count, pid).
pub const COMMON_SIZE: usize = 8;

/// One field of an event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Field {
    /// Its C type as tracefs writes it (`unsigned long`, `__data_loc
    /// char[]`).
    pub ty: String,
    /// Its name, with `[N]` for a fixed array.
    pub name: String,
    /// Offset from the start of the record.
    pub offset: usize,
    /// Size in bytes (4 for a `__data_loc`).
    pub size: usize,
    /// Whether it is signed.
    pub signed: bool,
}

/// An event: where it is, its id, fields and print format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventFormat {
    /// Its system (`ftrace`, `kprobes`, `sched`).
    pub system: String,
    /// Its name.
    pub name: String,
    /// The id its records carry in `common_type`.
    pub id: u16,
    /// Its own fields, after the common ones.
    pub fields: Vec<Field>,
    /// The `print fmt` line's value.
    pub print_fmt: String,
}

/// Builds an event's fields in order, each after the previous one.
#[derive(Debug)]
pub struct Layout {
    fields: Vec<Field>,
    end: usize,
}

impl Default for Layout {
    fn default() -> Self {
        Layout::new()
    }
}

impl Layout {
    /// After the common fields.
    pub fn new() -> Layout {
        Layout {
            fields: Vec::new(),
            end: COMMON_SIZE,
        }
    }

    /// Adds a field at the next offset (packed, as the kernel's probe
    /// arguments and the packed ftrace entries are).
    pub fn field(mut self, ty: &str, name: &str, size: usize, signed: bool) -> Layout {
        self.fields.push(Field {
            ty: ty.into(),
            name: name.into(),
            offset: self.end,
            size,
            signed,
        });
        self.end += size;
        self
    }

    /// The fields.
    pub fn done(self) -> Vec<Field> {
        self.fields
    }
}

impl EventFormat {
    /// Bytes of the fixed part of a record (dynamic data follows it).
    pub fn fixed_size(&self) -> usize {
        self.fields
            .iter()
            .map(|f| f.offset + f.size)
            .max()
            .unwrap_or(COMMON_SIZE)
    }

    /// The field named `name`.
    pub fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }

    /// The format file's text.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "name: {}", self.name);
        let _ = writeln!(s, "ID: {}", self.id);
        s.push_str("format:\n");
        let line = |s: &mut String, f: &Field| {
            let _ = writeln!(
                s,
                "\tfield:{} {};\toffset:{};\tsize:{};\tsigned:{};",
                f.ty,
                f.name,
                f.offset,
                f.size,
                u8::from(f.signed)
            );
        };
        for f in common_fields() {
            line(&mut s, &f);
        }
        s.push('\n');
        for f in &self.fields {
            line(&mut s, f);
        }
        let _ = writeln!(s, "\nprint fmt: {}", self.print_fmt);
        s
    }
}

/// The fields every event starts with.
pub fn common_fields() -> [Field; 4] {
    let f = |ty: &str, name: &str, offset, size, signed| Field {
        ty: ty.into(),
        name: name.into(),
        offset,
        size,
        signed,
    };
    [
        f("unsigned short", "common_type", 0, 2, false),
        f("unsigned char", "common_flags", 2, 1, false),
        f("unsigned char", "common_preempt_count", 3, 1, false),
        f("int", "common_pid", 4, 4, true),
    ]
}

/// The kernel's `header_page` text for 4 KiB pages and 64-bit longs.
pub fn header_page() -> String {
    format!(
        "\tfield: u64 timestamp;\toffset:0;\tsize:8;\tsigned:0;\n\
         \tfield: local_t commit;\toffset:8;\tsize:8;\tsigned:1;\n\
         \tfield: int overwrite;\toffset:8;\tsize:1;\tsigned:1;\n\
         \tfield: char data;\toffset:16;\tsize:{};\tsigned:1;\n",
        super::page::PAGE_DATA
    )
}

/// The kernel's `header_event` text.
pub fn header_event() -> String {
    "# compressed entry header\n\
     \ttype_len    :    5 bits\n\
     \ttime_delta  :   27 bits\n\
     \tarray       :   32 bits\n\
     \n\
     \tpadding     : type == 29\n\
     \ttime_extend : type == 30\n\
     \ttime_stamp : type == 31\n\
     \tdata max type_len  == 28\n"
        .into()
}

/// The kernel's ids of the ftrace events (`enum trace_type`).
pub const ID_FUNCTION: u16 = 1;
/// `funcgraph_exit` (`TRACE_GRAPH_RET`).
pub const ID_FUNCGRAPH_EXIT: u16 = 10;
/// `funcgraph_entry` (`TRACE_GRAPH_ENT`).
pub const ID_FUNCGRAPH_ENTRY: u16 = 11;
/// `sched/sched_switch`.
pub const ID_SCHED_SWITCH: u16 = 200;
/// `sched/sched_wakeup`.
pub const ID_SCHED_WAKEUP: u16 = 201;
/// The first id given to the other events (as the kernel numbers its
/// dynamic events after the fixed ones).
pub const FIRST_DYNAMIC_ID: u16 = 300;

/// `ftrace/function`.
pub fn function() -> EventFormat {
    EventFormat {
        system: "ftrace".into(),
        name: "function".into(),
        id: ID_FUNCTION,
        fields: Layout::new()
            .field("unsigned long", "ip", 8, false)
            .field("unsigned long", "parent_ip", 8, false)
            .done(),
        print_fmt: "\" %ps <-- %ps\", (void *)REC->ip, (void *)REC->parent_ip".into(),
    }
}

/// `ftrace/funcgraph_entry`.
pub fn funcgraph_entry() -> EventFormat {
    EventFormat {
        system: "ftrace".into(),
        name: "funcgraph_entry".into(),
        id: ID_FUNCGRAPH_ENTRY,
        fields: Layout::new()
            .field("unsigned long", "func", 8, false)
            .field("int", "depth", 4, true)
            .done(),
        print_fmt: "\"--> %ps (%d)\", (void *)REC->func, REC->depth".into(),
    }
}

/// `ftrace/funcgraph_exit`, with `retval`.
pub fn funcgraph_exit() -> EventFormat {
    EventFormat {
        system: "ftrace".into(),
        name: "funcgraph_exit".into(),
        id: ID_FUNCGRAPH_EXIT,
        fields: Layout::new()
            .field("unsigned long", "func", 8, false)
            .field("unsigned long", "retval", 8, false)
            .field("int", "depth", 4, true)
            .field("unsigned int", "overrun", 4, false)
            .field("unsigned long long", "calltime", 8, false)
            .field("unsigned long long", "rettime", 8, false)
            .done(),
        print_fmt: "\"<-- %ps (%d) (start: %llx  end: %llx) over: %d retval: %lx\", \
                    (void *)REC->func, REC->depth, REC->calltime, REC->rettime, \
                    REC->overrun, REC->retval"
            .into(),
    }
}

/// How a probe argument is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgField {
    /// An integer of this type.
    Int(IntType),
    /// A string (`__data_loc char[]`).
    Str,
}

impl ArgField {
    /// How a fetch type is stored: integers as they are, bitfields as
    /// their container, strings and symbols as strings (the stream carries
    /// a symbol as the text the kernel's `%pS` prints).
    pub fn of(ty: ArgType) -> ArgField {
        match ty {
            ArgType::Int(t) => ArgField::Int(t),
            ArgType::Bitfield { container, .. } => ArgField::Int(IntType::unsigned_of(container)),
            ArgType::String | ArgType::UString | ArgType::SymStr | ArgType::Symbol => ArgField::Str,
        }
    }
}

/// The C type, print conversion and sign of an integer fetch type, as
/// `trace_probe.c` has them.
fn int_field(t: IntType) -> (&'static str, &'static str, bool) {
    match t {
        IntType::U8 => ("u8", "%u", false),
        IntType::U16 => ("u16", "%u", false),
        IntType::U32 => ("u32", "%u", false),
        IntType::U64 => ("u64", "%Lu", false),
        IntType::S8 => ("s8", "%d", true),
        IntType::S16 => ("s16", "%d", true),
        IntType::S32 => ("s32", "%d", true),
        IntType::S64 => ("s64", "%Ld", true),
        IntType::X8 => ("u8", "0x%x", false),
        IntType::X16 => ("u16", "0x%x", false),
        IntType::X32 => ("u32", "0x%x", false),
        IntType::X64 => ("u64", "0x%Lx", false),
        IntType::Char => ("u8", "'%c'", false),
    }
}

/// A kprobe event (`is_return`: a kretprobe) with `args` (name, how
/// stored), as `trace_kprobe.c` defines it.
pub fn kprobe(
    system: &str,
    name: &str,
    id: u16,
    is_return: bool,
    args: &[(String, ArgField)],
) -> EventFormat {
    let mut layout = Layout::new();
    let (mut fmt, mut rec) = if is_return {
        layout = layout
            .field("unsigned long", "__probe_func", 8, false)
            .field("unsigned long", "__probe_ret_ip", 8, false);
        (
            String::from("\"(%lx <- %lx)"),
            String::from(", REC->__probe_func, REC->__probe_ret_ip"),
        )
    } else {
        layout = layout.field("unsigned long", "__probe_ip", 8, false);
        (String::from("\"(%lx)"), String::from(", REC->__probe_ip"))
    };
    for (arg, field) in args {
        match field {
            ArgField::Int(t) => {
                let (ty, conv, signed) = int_field(*t);
                layout = layout.field(ty, arg, t.size(), signed);
                let _ = write!(fmt, " {arg}={conv}");
                let _ = write!(rec, ", REC->{arg}");
            }
            ArgField::Str => {
                layout = layout.field("__data_loc char[]", arg, 4, true);
                let _ = write!(fmt, " {arg}=\\\"%s\\\"");
                let _ = write!(rec, ", __get_str({arg})");
            }
        }
    }
    EventFormat {
        system: system.into(),
        name: name.into(),
        id,
        fields: layout.done(),
        print_fmt: format!("{fmt}\"{rec}"),
    }
}

/// `sched/sched_switch`.
pub fn sched_switch(id: u16) -> EventFormat {
    EventFormat {
        system: "sched".into(),
        name: "sched_switch".into(),
        id,
        fields: Layout::new()
            .field("char", "prev_comm[16]", 16, false)
            .field("pid_t", "prev_pid", 4, true)
            .field("int", "prev_prio", 4, true)
            .field("long", "prev_state", 8, true)
            .field("char", "next_comm[16]", 16, false)
            .field("pid_t", "next_pid", 4, true)
            .field("int", "next_prio", 4, true)
            .done(),
        print_fmt: "\"prev_comm=%s prev_pid=%d prev_prio=%d prev_state=%s%s ==> next_comm=%s \
                    next_pid=%d next_prio=%d\", REC->prev_comm, REC->prev_pid, REC->prev_prio, \
                    (REC->prev_state & ((((0x00000000 | 0x00000001 | 0x00000002 | 0x00000004 | \
                    0x00000008 | 0x00000010 | 0x00000020 | 0x00000040) + 1) << 1) - 1)) ? \
                    __print_flags(REC->prev_state & ((((0x00000000 | 0x00000001 | 0x00000002 | \
                    0x00000004 | 0x00000008 | 0x00000010 | 0x00000020 | 0x00000040) + 1) << 1) - 1), \
                    \"|\", { 0x00000001, \"S\" }, { 0x00000002, \"D\" }, { 0x00000004, \"T\" }, \
                    { 0x00000008, \"t\" }, { 0x00000010, \"X\" }, { 0x00000020, \"Z\" }, \
                    { 0x00000040, \"P\" }, { 0x00000080, \"I\" }) : \"R\", \
                    REC->prev_state & (((0x00000000 | 0x00000001 | 0x00000002 | 0x00000004 | \
                    0x00000008 | 0x00000010 | 0x00000020 | 0x00000040) + 1) << 1) ? \"+\" : \"\", \
                    REC->next_comm, REC->next_pid, REC->next_prio"
            .into(),
    }
}

/// `sched/sched_wakeup`.
pub fn sched_wakeup(id: u16) -> EventFormat {
    EventFormat {
        system: "sched".into(),
        name: "sched_wakeup".into(),
        id,
        fields: Layout::new()
            .field("char", "comm[16]", 16, false)
            .field("pid_t", "pid", 4, true)
            .field("int", "prio", 4, true)
            .field("int", "target_cpu", 4, true)
            .done(),
        print_fmt: "\"comm=%s pid=%d prio=%d target_cpu=%03d\", REC->comm, REC->pid, REC->prio, \
                    REC->target_cpu"
            .into(),
    }
}
