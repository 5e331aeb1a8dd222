//! Safe owners of PJRT objects. Every `unsafe` block is one FFI call, or a read of memory the
//! plugin handed back, with its `// SAFETY:` reason. Objects hold an `Arc` of their client, so
//! a client lives as long as anything made from it, and each is destroyed exactly once on drop.

use std::ffi::c_char;
use std::ptr::{null, null_mut};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::sys::*;

/// Objects alive right now, per kind, for leak checks: `[clients, executables, buffers, events]`.
pub fn live_objects() -> [isize; 4] {
    [&LIVE[0], &LIVE[1], &LIVE[2], &LIVE[3]].map(|c| c.load(Relaxed))
}
static LIVE: [AtomicIsize; 4] = [
    AtomicIsize::new(0),
    AtomicIsize::new(0),
    AtomicIsize::new(0),
    AtomicIsize::new(0),
];
const CLIENTS: usize = 0;
const EXECUTABLES: usize = 1;
const BUFFERS: usize = 2;
const EVENTS: usize = 3;

fn local(context: &'static str, message: impl Into<String>) -> Error {
    Error::Plugin {
        context,
        code: -1,
        message: message.into(),
    }
}

/// Copies a (pointer, length) string owned by the plugin.
///
/// # Safety
/// `ptr` is null or points to `len` readable bytes alive for this call.
unsafe fn copy_str(ptr: *const c_char, len: usize) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by this function's contract.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

/// A loaded plugin's function table. Plugins are never unloaded (they own threads and static
/// state), so the table lives for the process.
pub struct Api {
    table: *const PJRT_Api,
}

// SAFETY: the table is immutable static data of the plugin; PJRT entry points are thread-safe.
unsafe impl Send for Api {}
// SAFETY: as above.
unsafe impl Sync for Api {}

impl Api {
    /// `dlopen`s the plugin, calls `GetPjrtApi` and `PJRT_Plugin_Initialize`.
    pub fn load(path: &str) -> Result<&'static Api> {
        let err = |message: String| Error::Load {
            path: path.to_string(),
            message,
        };
        // SAFETY: loading runs the library's initialisers; a PJRT plugin is a trusted shared
        // object named by the user.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| err(e.to_string()))?;
        let lib: &'static libloading::Library = Box::leak(Box::new(lib));
        // SAFETY: the header declares `const PJRT_Api* GetPjrtApi(void)`.
        let get = unsafe { lib.get::<GetPjrtApiFn>(b"GetPjrtApi\0") }
            .map_err(|e| err(format!("not a PJRT plugin: {e}")))?;
        // SAFETY: no arguments; returns a pointer to a static table.
        let table = unsafe { get() };
        if table.is_null() {
            return Err(err("GetPjrtApi returned null".into()));
        }
        let api: &'static Api = Box::leak(Box::new(Api { table }));
        let have = api.t().struct_size;
        if have < PJRT_API_STRUCT_SIZE {
            return Err(err(format!(
                "its PJRT_Api has {have} bytes, C-API 0.81 needs {PJRT_API_STRUCT_SIZE}: plugin too old"
            )));
        }
        let mut a = PJRT_Plugin_Initialize_Args::new();
        // SAFETY: no input pointers besides the args struct.
        unsafe {
            api.call(
                "PJRT_Plugin_Initialize",
                api.t().PJRT_Plugin_Initialize,
                &mut a,
            )?
        };
        Ok(api)
    }

    fn t(&self) -> &PJRT_Api {
        // SAFETY: non-null (checked in `load`), covers our whole definition (checked), and the
        // plugin is never unloaded.
        unsafe { &*self.table }
    }

    /// `(major, minor)` of the plugin's C API.
    pub fn version(&self) -> (i32, i32) {
        let v = &self.t().pjrt_api_version;
        (v.major_version, v.minor_version)
    }

    /// Calls an entry point and turns its `PJRT_Error*` into a `Result`.
    ///
    /// # Safety
    /// `args` must meet that entry point's contract: every input pointer valid for the call.
    unsafe fn call<A>(&self, ctx: &'static str, f: ApiFn<A>, args: &mut A) -> Result<()> {
        let f = f.ok_or_else(|| local(ctx, "the plugin left this PJRT_Api slot null"))?;
        // SAFETY: per this function's contract; `args` is a live #[repr(C)] struct.
        let err = unsafe { f(args) };
        self.take_error(err, ctx)
    }

    /// Reads code and message out of a plugin error, then destroys it.
    fn take_error(&self, err: *mut PJRT_Error, ctx: &'static str) -> Result<()> {
        if err.is_null() {
            return Ok(());
        }
        let mut m = PJRT_Error_Message_Args::new();
        m.error = err;
        let message = match self.t().PJRT_Error_Message {
            Some(f) => {
                // SAFETY: `err` is a live error the plugin returned; `m` is valid.
                unsafe { f(&mut m) };
                // SAFETY: the message lives as long as `err`, destroyed only below.
                unsafe { copy_str(m.message, m.message_size) }
            }
            None => String::from("(no PJRT_Error_Message)"),
        };
        let mut c = PJRT_Error_GetCode_Args::new();
        c.error = err;
        let code = match self.t().PJRT_Error_GetCode {
            Some(f) => {
                // SAFETY: as above.
                let e2 = unsafe { f(&mut c) };
                self.destroy_error(e2);
                c.code
            }
            None => 2,
        };
        self.destroy_error(err);
        Err(Error::Plugin {
            context: ctx,
            code,
            message,
        })
    }

    fn destroy_error(&self, err: *mut PJRT_Error) {
        if err.is_null() {
            return;
        }
        let mut d = PJRT_Error_Destroy_Args::new();
        d.error = err;
        if let Some(f) = self.t().PJRT_Error_Destroy {
            // SAFETY: `err` is a live error we own; not used again.
            unsafe { f(&mut d) };
        }
    }

    /// A new client on this plugin, with the plugin's default options.
    pub fn client(&'static self) -> Result<Client> {
        self.client_with(&ClientOptions::default())
    }

    /// A new client with `PJRT_Client_Create` options.
    pub fn client_with(&'static self, options: &ClientOptions) -> Result<Client> {
        let mut named = Vec::new();
        if let Some(n) = options.cpu_device_count {
            // 0 (or a negative count) gives a client without devices on the XLA CPU plugin
            let n = i64::try_from(n).ok().filter(|&n| n >= 1).ok_or_else(|| {
                crate::error::invalid("cpu_device_count", format!("must be >= 1, got {n}"))
            })?;
            named.push(int64_option(CPU_DEVICE_COUNT, n));
        }
        let mut a = PJRT_Client_Create_Args::new();
        if !named.is_empty() {
            a.create_options = named.as_ptr();
            a.num_options = named.len();
        }
        // SAFETY: `named` outlives the call and its names are 'static (the plugin copies what
        // it keeps); each value has the type the option is read as; no key-value callbacks.
        unsafe { self.call("PJRT_Client_Create", self.t().PJRT_Client_Create, &mut a)? };
        if a.client.is_null() {
            return Err(local("PJRT_Client_Create", "returned a null client"));
        }
        LIVE[CLIENTS].fetch_add(1, Relaxed);
        Ok(Client {
            inner: Arc::new(ClientInner {
                api: self,
                raw: a.client,
            }),
        })
    }
}

/// Options for [`Api::client_with`]; `None` leaves the plugin's default.
///
/// Typed rather than free-form name/value pairs on purpose: the XLA CPU plugin reads an
/// option's value as the type it expects without checking, and a value of another type
/// throws a C++ exception through the C API, which aborts the process. Names a plugin does
/// not know are ignored by this wheel's CPU plugin and refused (an error) by newer ones.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientOptions {
    /// `cpu_device_count` (int64): how many host devices the XLA CPU plugin exposes (its
    /// default is 4; `XLA_FLAGS=--xla_force_host_platform_device_count` does not change it).
    pub cpu_device_count: Option<usize>,
}

const CPU_DEVICE_COUNT: &str = "cpu_device_count";

fn int64_option(name: &'static str, value: i64) -> PJRT_NamedValue {
    let mut v = PJRT_NamedValue::new();
    v.name = name.as_ptr().cast::<c_char>();
    v.name_size = name.len();
    v.type_ = PJRT_NamedValue_kInt64;
    v.value.int64_value = value;
    // a scalar counts as one value
    v.value_size = 1;
    v
}

struct ClientInner {
    api: &'static Api,
    raw: *mut PJRT_Client,
}

// SAFETY: a PJRT client is thread-safe (the C API is called from many threads by frameworks).
unsafe impl Send for ClientInner {}
// SAFETY: as above.
unsafe impl Sync for ClientInner {}

impl Drop for ClientInner {
    fn drop(&mut self) {
        let mut a = PJRT_Client_Destroy_Args::new();
        a.client = self.raw;
        // SAFETY: our live client; everything made from it holds this Arc, so is gone.
        let r = unsafe {
            self.api.call(
                "PJRT_Client_Destroy",
                self.api.t().PJRT_Client_Destroy,
                &mut a,
            )
        };
        LIVE[CLIENTS].fetch_sub(1, Relaxed);
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}

/// A PJRT client (shared; clones are cheap).
#[derive(Clone)]
pub struct Client {
    inner: Arc<ClientInner>,
}

/// The element types we move across.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElementType {
    U8,
    F32,
}

impl ElementType {
    fn raw(self) -> PJRT_Buffer_Type {
        match self {
            ElementType::U8 => PJRT_Buffer_Type_U8,
            ElementType::F32 => PJRT_Buffer_Type_F32,
        }
    }
}

impl Client {
    fn api(&self) -> &'static Api {
        self.inner.api
    }

    pub fn platform_name(&self) -> Result<String> {
        let mut a = PJRT_Client_PlatformName_Args::new();
        a.client = self.inner.raw;
        // SAFETY: live client.
        unsafe {
            self.api().call(
                "PJRT_Client_PlatformName",
                self.api().t().PJRT_Client_PlatformName,
                &mut a,
            )?
        };
        // SAFETY: owned by the live client.
        Ok(unsafe { copy_str(a.platform_name, a.platform_name_size) })
    }

    /// The first addressable device.
    pub fn device(&self) -> Result<Device> {
        self.devices()?
            .into_iter()
            .next()
            .ok_or_else(|| local("PJRT_Client_AddressableDevices", "the client has no device"))
    }

    /// Every addressable device, in the plugin's order.
    pub fn devices(&self) -> Result<Vec<Device>> {
        let mut a = PJRT_Client_AddressableDevices_Args::new();
        a.client = self.inner.raw;
        // SAFETY: live client.
        unsafe {
            self.api().call(
                "PJRT_Client_AddressableDevices",
                self.api().t().PJRT_Client_AddressableDevices,
                &mut a,
            )?
        };
        if a.addressable_devices.is_null() || a.num_addressable_devices == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: an array of `num_addressable_devices` pointers owned by the live client.
        let raw =
            unsafe { std::slice::from_raw_parts(a.addressable_devices, a.num_addressable_devices) };
        Ok(raw
            .iter()
            .map(|&raw| Device {
                client: self.inner.clone(),
                raw,
            })
            .collect())
    }

    /// Compiles `code` (`format` "mlir" for StableHLO text) with `options` (a serialized
    /// `xla.CompileOptionsProto`).
    pub fn compile(&self, code: &str, format: &str, options: &[u8]) -> Result<Executable> {
        let mut code_buf = code.as_bytes().to_vec();
        let mut prog = PJRT_Program::new();
        prog.code = code_buf.as_mut_ptr().cast::<c_char>();
        prog.code_size = code_buf.len();
        prog.format = format.as_ptr().cast::<c_char>();
        prog.format_size = format.len();
        let mut a = PJRT_Client_Compile_Args::new();
        a.client = self.inner.raw;
        a.program = &prog;
        a.compile_options = options.as_ptr().cast::<c_char>();
        a.compile_options_size = options.len();
        // SAFETY: live client; program, code, format and options outlive the call.
        unsafe {
            self.api().call(
                "PJRT_Client_Compile",
                self.api().t().PJRT_Client_Compile,
                &mut a,
            )?
        };
        if a.executable.is_null() {
            return Err(local("PJRT_Client_Compile", "returned a null executable"));
        }
        LIVE[EXECUTABLES].fetch_add(1, Relaxed);
        let mut exe = Executable {
            client: self.inner.clone(),
            raw: a.executable,
            num_outputs: 0,
        };
        exe.num_outputs = exe.with_executable(|e| exe.num_outputs_of(e))?;
        Ok(exe)
    }

    /// Compiles StableHLO text carrying `mhlo.sharding` annotations for XLA's SPMD
    /// partitioner: one replica, partition `i` on `devices[i]`. Run the result with
    /// [`Executable::execute_sharded`], argument list `i` holding the shards of `devices[i]`.
    pub fn compile_spmd(&self, code: &str, devices: &[Device]) -> Result<Executable> {
        if devices.is_empty() {
            return Err(crate::error::invalid(
                "devices",
                "an SPMD program needs at least one device",
            ));
        }
        if devices.iter().any(|d| !Arc::ptr_eq(&d.client, &self.inner)) {
            return Err(crate::error::invalid(
                "devices",
                "a device belongs to another PJRT client",
            ));
        }
        let ids = devices
            .iter()
            .map(|d| d.id().map(i64::from))
            .collect::<Result<Vec<i64>>>()?;
        // each partition runs on its own device; refused here rather than left to XLA
        if let Some(i) = (1..ids.len()).find(|&i| ids[..i].contains(&ids[i])) {
            return Err(crate::error::invalid(
                "devices",
                format!("device {} is listed twice", ids[i]),
            ));
        }
        self.compile(code, "mlir", &crate::proto::spmd_compile_options(&ids))
    }

    /// Uploads a dense row-major host array to `device`; returns once the host data is no
    /// longer needed.
    pub fn upload(
        &self,
        data: &[u8],
        ty: ElementType,
        dims: &[i64],
        device: &Device,
    ) -> Result<Buffer> {
        let width: i64 = match ty {
            ElementType::U8 => 1,
            ElementType::F32 => 4,
        };
        // a device handle of another client would reach into that client's state
        if !Arc::ptr_eq(&device.client, &self.inner) {
            return Err(crate::error::invalid(
                "device",
                "belongs to another PJRT client",
            ));
        }
        // the plugin reads exactly prod(dims) * width bytes: that must be `data`, no more
        let bytes = dims.iter().try_fold(
            width,
            |acc, &d| {
                if d < 0 {
                    None
                } else {
                    acc.checked_mul(d)
                }
            },
        );
        if bytes != Some(data.len() as i64) {
            return Err(crate::error::invalid(
                "upload",
                format!("{} bytes for dims {dims:?} of {ty:?}", data.len()),
            ));
        }
        let mut a = PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.inner.raw;
        a.data = data.as_ptr().cast();
        a.type_ = ty.raw();
        a.dims = dims.as_ptr();
        a.num_dims = dims.len();
        a.byte_strides = null();
        a.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes;
        a.device = device.raw;
        a.memory = null_mut();
        a.device_layout = null_mut();
        // SAFETY: client and device are live; `data` and `dims` outlive the call, and we await
        // `done_with_host_buffer` before returning, as that semantics requires.
        unsafe {
            self.api().call(
                "PJRT_Client_BufferFromHostBuffer",
                self.api().t().PJRT_Client_BufferFromHostBuffer,
                &mut a,
            )?
        };
        let done = Event::adopt(self.api(), a.done_with_host_buffer);
        let buffer = Buffer::adopt(&self.inner, a.buffer);
        if let Some(done) = done {
            done.wait("PJRT_Event_Await(done_with_host_buffer)")?;
        }
        buffer.ok_or_else(|| local("PJRT_Client_BufferFromHostBuffer", "returned a null buffer"))
    }
}

/// A device of a client (owned by the client).
#[derive(Clone)]
pub struct Device {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Device,
}

impl Device {
    /// The device's global id: what a `DeviceAssignmentProto` names it by.
    pub fn id(&self) -> Result<i32> {
        let api = self.client.api;
        let mut d = PJRT_Device_GetDescription_Args::new();
        d.device = self.raw;
        // SAFETY: a device of the live client this handle keeps alive.
        unsafe {
            api.call(
                "PJRT_Device_GetDescription",
                api.t().PJRT_Device_GetDescription,
                &mut d,
            )?
        };
        if d.device_description.is_null() {
            return Err(local("PJRT_Device_GetDescription", "returned null"));
        }
        let mut a = PJRT_DeviceDescription_Id_Args::new();
        a.device_description = d.device_description;
        // SAFETY: the description is owned by the live device.
        unsafe {
            api.call(
                "PJRT_DeviceDescription_Id",
                api.t().PJRT_DeviceDescription_Id,
                &mut a,
            )?
        };
        Ok(a.id)
    }
}

// SAFETY: a device handle is an immutable pointer into a thread-safe client.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

struct Event {
    api: &'static Api,
    raw: *mut PJRT_Event,
}

impl Event {
    fn adopt(api: &'static Api, raw: *mut PJRT_Event) -> Option<Self> {
        if raw.is_null() {
            return None;
        }
        LIVE[EVENTS].fetch_add(1, Relaxed);
        Some(Event { api, raw })
    }

    fn wait(&self, ctx: &'static str) -> Result<()> {
        let mut a = PJRT_Event_Await_Args::new();
        a.event = self.raw;
        // SAFETY: a live event we own.
        unsafe { self.api.call(ctx, self.api.t().PJRT_Event_Await, &mut a) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let mut a = PJRT_Event_Destroy_Args::new();
        a.event = self.raw;
        // SAFETY: a live event we own; not used afterwards.
        let r = unsafe {
            self.api.call(
                "PJRT_Event_Destroy",
                self.api.t().PJRT_Event_Destroy,
                &mut a,
            )
        };
        LIVE[EVENTS].fetch_sub(1, Relaxed);
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}

/// A compiled program, loaded on the client's devices.
pub struct Executable {
    client: Arc<ClientInner>,
    raw: *mut PJRT_LoadedExecutable,
    num_outputs: usize,
}

// SAFETY: loaded executables may be executed from any thread (PJRT is thread-safe).
unsafe impl Send for Executable {}
// SAFETY: as above.
unsafe impl Sync for Executable {}

impl Executable {
    fn api(&self) -> &'static Api {
        self.client.api
    }

    /// Runs `f` on the (owned, then destroyed) `PJRT_Executable` behind this one.
    fn with_executable<T>(&self, f: impl FnOnce(*mut PJRT_Executable) -> Result<T>) -> Result<T> {
        let mut a = PJRT_LoadedExecutable_GetExecutable_Args::new();
        a.loaded_executable = self.raw;
        // SAFETY: our live loaded executable.
        unsafe {
            self.api().call(
                "PJRT_LoadedExecutable_GetExecutable",
                self.api().t().PJRT_LoadedExecutable_GetExecutable,
                &mut a,
            )?
        };
        if a.executable.is_null() {
            return Err(local(
                "PJRT_LoadedExecutable_GetExecutable",
                "returned null",
            ));
        }
        let out = f(a.executable);
        let mut d = PJRT_Executable_Destroy_Args::new();
        d.executable = a.executable;
        // SAFETY: GetExecutable handed us this executable to own; not used afterwards.
        let r = unsafe {
            self.api().call(
                "PJRT_Executable_Destroy",
                self.api().t().PJRT_Executable_Destroy,
                &mut d,
            )
        };
        r.and(out)
    }

    fn num_outputs_of(&self, e: *mut PJRT_Executable) -> Result<usize> {
        let mut a = PJRT_Executable_NumOutputs_Args::new();
        a.executable = e;
        // SAFETY: `e` is live for this call.
        unsafe {
            self.api().call(
                "PJRT_Executable_NumOutputs",
                self.api().t().PJRT_Executable_NumOutputs,
                &mut a,
            )?
        };
        Ok(a.num_outputs)
    }

    /// The optimized program as the plugin reports it: `(format, bytes)`; for XLA plugins
    /// `("hlo_with_config", serialized xla.HloModuleProtoWithConfig)`.
    pub fn optimized_program(&self) -> Result<(String, Vec<u8>)> {
        self.with_executable(|e| {
            let mut prog = PJRT_Program::new();
            let mut a = PJRT_Executable_OptimizedProgram_Args::new();
            a.executable = e;
            a.program = &mut prog;
            let f = self.api().t().PJRT_Executable_OptimizedProgram;
            // SAFETY: `e` is live; code = null asks for the size only.
            unsafe {
                self.api()
                    .call("PJRT_Executable_OptimizedProgram", f, &mut a)?
            };
            let mut buf = vec![0u8; prog.code_size];
            prog.code = buf.as_mut_ptr().cast::<c_char>();
            // SAFETY: `code` now points to `code_size` writable bytes outliving the call.
            unsafe {
                self.api()
                    .call("PJRT_Executable_OptimizedProgram", f, &mut a)?
            };
            // SAFETY: a static string owned by the plugin.
            let format = unsafe { copy_str(prog.format, prog.format_size) };
            buf.truncate(prog.code_size);
            Ok((format, buf))
        })
    }

    /// Runs on one device and waits for completion; returns the outputs.
    pub fn execute(&self, args: &[&Buffer]) -> Result<Vec<Buffer>> {
        let mut outs = self.execute_sharded(&[args])?;
        Ok(outs.pop().unwrap_or_default())
    }

    /// Runs one program on several devices at once (an SPMD executable compiled for
    /// `args.len()` partitions) and waits for all of them. `args[i]` are the buffers of the
    /// executable's `i`-th addressable device, which for an explicit device assignment is its
    /// `i`-th partition; every list holds the same number of buffers. Returns the outputs per
    /// device, in the same order.
    pub fn execute_sharded(&self, args: &[&[&Buffer]]) -> Result<Vec<Vec<Buffer>>> {
        let num_args = args.first().map_or(0, |a| a.len());
        if args.is_empty() || args.iter().any(|a| a.len() != num_args) {
            return Err(crate::error::invalid(
                "args",
                format!(
                    "needs one equally long argument list per device, got lengths {:?}",
                    args.iter().map(|a| a.len()).collect::<Vec<_>>()
                ),
            ));
        }
        // a buffer of another client would be read as this client's
        if args
            .iter()
            .flat_map(|l| l.iter())
            .any(|b| !Arc::ptr_eq(&b.client, &self.client))
        {
            return Err(crate::error::invalid(
                "args",
                "a buffer belongs to another PJRT client",
            ));
        }
        let arg_ptrs: Vec<Vec<*mut PJRT_Buffer>> = args
            .iter()
            .map(|list| list.iter().map(|b| b.raw).collect())
            .collect();
        let arg_lists: Vec<*const *mut PJRT_Buffer> = arg_ptrs.iter().map(|l| l.as_ptr()).collect();
        let mut outs: Vec<Vec<*mut PJRT_Buffer>> =
            vec![vec![null_mut(); self.num_outputs]; args.len()];
        let out_lists: Vec<*mut *mut PJRT_Buffer> =
            outs.iter_mut().map(|l| l.as_mut_ptr()).collect();
        let mut done: Vec<*mut PJRT_Event> = vec![null_mut(); args.len()];
        let mut opts = PJRT_ExecuteOptions::new();
        let mut a = PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = self.raw;
        a.options = &mut opts;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = args.len();
        a.num_args = num_args;
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = done.as_mut_ptr();
        a.execute_device = null_mut();
        // SAFETY: executable and argument buffers are live; arguments are
        // [num_devices][num_args], outputs [num_devices][num_outputs] as the executable
        // reports, events [num_devices]; all outlive the call. A device count the executable
        // was not compiled for is the plugin's to refuse, with an error.
        unsafe {
            self.api().call(
                "PJRT_LoadedExecutable_Execute",
                self.api().t().PJRT_LoadedExecutable_Execute,
                &mut a,
            )?
        };
        // adopt everything first, so an error below still frees what the plugin handed us
        let events: Vec<Event> = done
            .iter()
            .filter_map(|&raw| Event::adopt(self.api(), raw))
            .collect();
        let buffers: Vec<Vec<Buffer>> = outs
            .iter()
            .map(|list| {
                list.iter()
                    .filter_map(|&raw| Buffer::adopt(&self.client, raw))
                    .collect()
            })
            .collect();
        for ev in &events {
            ev.wait("PJRT_Event_Await(execute)")?;
        }
        if buffers.iter().any(|l| l.len() != self.num_outputs) {
            return Err(local(
                "PJRT_LoadedExecutable_Execute",
                "some outputs were null",
            ));
        }
        Ok(buffers)
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = PJRT_LoadedExecutable_Destroy_Args::new();
        a.executable = self.raw;
        // SAFETY: our live loaded executable; not used afterwards.
        let r = unsafe {
            self.api().call(
                "PJRT_LoadedExecutable_Destroy",
                self.api().t().PJRT_LoadedExecutable_Destroy,
                &mut a,
            )
        };
        LIVE[EXECUTABLES].fetch_sub(1, Relaxed);
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}

/// A device buffer.
pub struct Buffer {
    client: Arc<ClientInner>,
    raw: *mut PJRT_Buffer,
}

// SAFETY: PJRT buffers may be used and destroyed from any thread.
unsafe impl Send for Buffer {}
// SAFETY: as above; all our methods only read through the handle.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn adopt(client: &Arc<ClientInner>, raw: *mut PJRT_Buffer) -> Option<Self> {
        if raw.is_null() {
            return None;
        }
        LIVE[BUFFERS].fetch_add(1, Relaxed);
        Some(Buffer {
            client: client.clone(),
            raw,
        })
    }

    fn api(&self) -> &'static Api {
        self.client.api
    }

    pub fn dims(&self) -> Result<Vec<i64>> {
        let mut a = PJRT_Buffer_Dimensions_Args::new();
        a.buffer = self.raw;
        // SAFETY: our live buffer.
        unsafe {
            self.api().call(
                "PJRT_Buffer_Dimensions",
                self.api().t().PJRT_Buffer_Dimensions,
                &mut a,
            )?
        };
        if a.dims.is_null() {
            return Ok(vec![]);
        }
        // SAFETY: `num_dims` values owned by the live buffer.
        Ok(unsafe { std::slice::from_raw_parts(a.dims, a.num_dims) }.to_vec())
    }

    /// The buffer's bytes on the host.
    pub fn to_host(&self) -> Result<Vec<u8>> {
        let f = self.api().t().PJRT_Buffer_ToHostBuffer;
        let mut q = PJRT_Buffer_ToHostBuffer_Args::new();
        q.src = self.raw;
        // SAFETY: live buffer; dst = null asks for the size only.
        unsafe { self.api().call("PJRT_Buffer_ToHostBuffer", f, &mut q)? };
        drop(Event::adopt(self.api(), q.event));
        let mut host = vec![0u8; q.dst_size];
        let mut a = PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        a.dst = host.as_mut_ptr().cast();
        a.dst_size = host.len();
        // SAFETY: `dst` holds `dst_size` writable bytes, untouched until the event completes.
        unsafe { self.api().call("PJRT_Buffer_ToHostBuffer", f, &mut a)? };
        if let Some(ev) = Event::adopt(self.api(), a.event) {
            ev.wait("PJRT_Event_Await(to_host)")?;
        }
        Ok(host)
    }

    /// The buffer as f32 values.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        Ok(self
            .to_host()?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = PJRT_Buffer_Destroy_Args::new();
        a.buffer = self.raw;
        // SAFETY: our live buffer; not used afterwards.
        let r = unsafe {
            self.api().call(
                "PJRT_Buffer_Destroy",
                self.api().t().PJRT_Buffer_Destroy,
                &mut a,
            )
        };
        LIVE[BUFFERS].fetch_sub(1, Relaxed);
        if let Err(e) = r {
            tracing::warn!("{e}");
        }
    }
}
