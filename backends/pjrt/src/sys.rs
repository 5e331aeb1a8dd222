//! Raw C ABI of the PJRT C API 0.81, written from `pjrt_c_api.h` (as shipped with the
//! `xla-cpu-pjrt` plugin). Only the structs we use are defined, each with every field of that
//! header version in order; `PJRT_Api` declares all 118 function slots so that offsets match.
//! `STRUCT_SIZE` follows the header's `PJRT_STRUCT_SIZE` rule (offset of the last field plus its
//! size), which is what the plugin checks.
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code
)]

use std::os::raw::{c_char, c_int, c_void};

// ---- opaque handles --------------------------------------------------
#[repr(C)]
pub struct PJRT_Error {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Event {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Client {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Device {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_DeviceDescription {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Memory {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Executable {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_LoadedExecutable {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Buffer {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_ExecuteContext {
    _p: [u8; 0],
}
/// We never build extension chains; `extension_start` is always null.
pub type PJRT_Extension_Base = c_void;

// ---- C enums (int-sized on the x86-64 / aarch64 SysV ABIs) ------------
pub type PJRT_Error_Code = c_int;
pub type PJRT_NamedValue_Type = c_int;
pub type PJRT_Buffer_Type = c_int;
pub type PJRT_HostBufferSemantics = c_int;

pub const PJRT_NamedValue_kString: c_int = 0;
pub const PJRT_NamedValue_kInt64: c_int = 1;
pub const PJRT_NamedValue_kInt64List: c_int = 2;
pub const PJRT_NamedValue_kFloat: c_int = 3;
pub const PJRT_NamedValue_kBool: c_int = 4;

// PJRT_Buffer_Type values we use (position in the header's enum).
pub const PJRT_Buffer_Type_U8: c_int = 6;
pub const PJRT_Buffer_Type_F32: c_int = 11;
pub const PJRT_Buffer_Type_F8E4M3FN: c_int = 17;

pub const PJRT_HostBufferSemantics_kImmutableOnlyDuringCall: c_int = 0;
pub const PJRT_HostBufferSemantics_kImmutableUntilTransferCompletes: c_int = 1;

/// Entry point taking `Args*` and returning `PJRT_Error*` (most of them).
pub type ApiFn<A> = Option<unsafe extern "C" fn(*mut A) -> *mut PJRT_Error>;
/// Entry point taking `Args*` and returning void (PJRT_Error_Destroy/Message).
pub type VoidFn<A> = Option<unsafe extern "C" fn(*mut A)>;
/// Slot of the function table that this POC never calls. Only its size
/// (one pointer) and position matter.
pub type Unused = Option<unsafe extern "C" fn()>;

/// Implements `STRUCT_SIZE` (= the header's PJRT_STRUCT_SIZE(T, last_field),
/// i.e. offsetof(last) + sizeof(last), *without* trailing padding) and a
/// zero-initialising `new()` that fills in `struct_size`.
/// The closure const checks at compile time that `$last` really has type
/// `$lty`, and the assert checks that `$last` is the final field (nothing
/// but alignment padding after it).
macro_rules! pjrt_struct {
    ($name:ident, $last:ident : $lty:ty) => {
        impl $name {
            pub const STRUCT_SIZE: usize =
                core::mem::offset_of!($name, $last) + core::mem::size_of::<$lty>();
            pub fn new() -> Self {
                // SAFETY: every field of these structs is a raw pointer, an
                // integer, a bool, a C-enum-as-int, an Option<fn>, or a
                // nested struct/union of those; all-zero bytes is a valid
                // value for each (null / 0 / false / None).
                let mut s: Self = unsafe { core::mem::zeroed() };
                s.struct_size = Self::STRUCT_SIZE;
                s
            }
        }
        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }
        const _: fn(&$name) -> &$lty = |s: &$name| &s.$last;
        const _: () = assert!(
            $name::STRUCT_SIZE <= core::mem::size_of::<$name>()
                && core::mem::size_of::<$name>() - $name::STRUCT_SIZE
                    < core::mem::align_of::<$name>()
        );
    };
}

// ---- version / errors ---------------------------------------------------
#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub major_version: c_int,
    pub minor_version: c_int,
}
pjrt_struct!(PJRT_Api_Version, minor_version: c_int);

#[repr(C)]
pub struct PJRT_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub error: *mut PJRT_Error,
}
pjrt_struct!(PJRT_Error_Destroy_Args, error: *mut PJRT_Error);

#[repr(C)]
pub struct PJRT_Error_Message_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub error: *const PJRT_Error,
    pub message: *const c_char, // out, lifetime of `error`
    pub message_size: usize,    // out
}
pjrt_struct!(PJRT_Error_Message_Args, message_size: usize);

#[repr(C)]
pub struct PJRT_Error_GetCode_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub error: *const PJRT_Error,
    pub code: PJRT_Error_Code, // out
}
pjrt_struct!(PJRT_Error_GetCode_Args, code: PJRT_Error_Code);

// ---- named values / plugin ---------------------------------------------
#[repr(C)]
#[derive(Clone, Copy)]
pub union PJRT_NamedValue_Value {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

#[repr(C)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub name: *const c_char,
    pub name_size: usize,
    pub type_: PJRT_NamedValue_Type,
    pub value: PJRT_NamedValue_Value,
    pub value_size: usize,
}
pjrt_struct!(PJRT_NamedValue, value_size: usize);

#[repr(C)]
pub struct PJRT_Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
}
pjrt_struct!(PJRT_Plugin_Initialize_Args, extension_start: *mut PJRT_Extension_Base);

#[repr(C)]
pub struct PJRT_Plugin_Attributes_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub attributes: *const PJRT_NamedValue, // out, process lifetime
    pub num_attributes: usize,              // out
}
pjrt_struct!(PJRT_Plugin_Attributes_Args, num_attributes: usize);

// ---- events --------------------------------------------------------------
#[repr(C)]
pub struct PJRT_Event_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub event: *mut PJRT_Event,
}
pjrt_struct!(PJRT_Event_Destroy_Args, event: *mut PJRT_Event);

#[repr(C)]
pub struct PJRT_Event_Await_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub event: *mut PJRT_Event,
}
pjrt_struct!(PJRT_Event_Await_Args, event: *mut PJRT_Event);

// ---- client ---------------------------------------------------------------
#[repr(C)]
pub struct PJRT_Client_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub create_options: *const PJRT_NamedValue,
    pub num_options: usize,
    pub kv_get_callback: Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>,
    pub kv_get_user_arg: *mut c_void,
    pub kv_put_callback: Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>,
    pub kv_put_user_arg: *mut c_void,
    pub client: *mut PJRT_Client, // out
    pub kv_try_get_callback: Option<unsafe extern "C" fn(*mut c_void) -> *mut PJRT_Error>,
    pub kv_try_get_user_arg: *mut c_void,
}
pjrt_struct!(PJRT_Client_Create_Args, kv_try_get_user_arg: *mut c_void);

#[repr(C)]
pub struct PJRT_Client_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
}
pjrt_struct!(PJRT_Client_Destroy_Args, client: *mut PJRT_Client);

#[repr(C)]
pub struct PJRT_Client_PlatformName_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
    pub platform_name: *const c_char, // out, owned by client
    pub platform_name_size: usize,    // out
}
pjrt_struct!(PJRT_Client_PlatformName_Args, platform_name_size: usize);

#[repr(C)]
pub struct PJRT_Client_PlatformVersion_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
    pub platform_version: *const c_char, // out, owned by client
    pub platform_version_size: usize,    // out
}
pjrt_struct!(PJRT_Client_PlatformVersion_Args, platform_version_size: usize);

#[repr(C)]
pub struct PJRT_Client_AddressableDevices_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
    pub addressable_devices: *const *mut PJRT_Device, // out, owned by client
    pub num_addressable_devices: usize,               // out
}
pjrt_struct!(PJRT_Client_AddressableDevices_Args, num_addressable_devices: usize);

#[repr(C)]
pub struct PJRT_Program {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub code: *mut c_char,
    pub code_size: usize,
    pub format: *const c_char,
    pub format_size: usize,
}
pjrt_struct!(PJRT_Program, format_size: usize);

#[repr(C)]
pub struct PJRT_Client_Compile_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
    pub program: *const PJRT_Program,
    pub compile_options: *const c_char, // serialized xla.CompileOptionsProto
    pub compile_options_size: usize,
    pub executable: *mut PJRT_LoadedExecutable, // out
}
pjrt_struct!(PJRT_Client_Compile_Args, executable: *mut PJRT_LoadedExecutable);

#[repr(C)]
pub struct PJRT_Client_BufferFromHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub client: *mut PJRT_Client,
    pub data: *const c_void,
    pub type_: PJRT_Buffer_Type,
    pub dims: *const i64,
    pub num_dims: usize,
    pub byte_strides: *const i64,
    pub num_byte_strides: usize,
    pub host_buffer_semantics: PJRT_HostBufferSemantics,
    pub device: *mut PJRT_Device,
    pub memory: *mut PJRT_Memory,
    pub device_layout: *mut c_void, // PJRT_Buffer_MemoryLayout*, always null here
    pub done_with_host_buffer: *mut PJRT_Event, // out, caller destroys
    pub buffer: *mut PJRT_Buffer,   // out, caller destroys
}
pjrt_struct!(PJRT_Client_BufferFromHostBuffer_Args, buffer: *mut PJRT_Buffer);

// ---- device / device description -------------------------------------------
#[repr(C)]
pub struct PJRT_Device_GetDescription_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub device: *mut PJRT_Device,
    pub device_description: *mut PJRT_DeviceDescription, // out
}
pjrt_struct!(PJRT_Device_GetDescription_Args, device_description: *mut PJRT_DeviceDescription);

#[repr(C)]
pub struct PJRT_DeviceDescription_Id_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub device_description: *mut PJRT_DeviceDescription,
    pub id: c_int, // out
}
pjrt_struct!(PJRT_DeviceDescription_Id_Args, id: c_int);

#[repr(C)]
pub struct PJRT_DeviceDescription_Kind_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub device_description: *mut PJRT_DeviceDescription,
    pub device_kind: *const c_char, // out
    pub device_kind_size: usize,    // out
}
pjrt_struct!(PJRT_DeviceDescription_Kind_Args, device_kind_size: usize);

#[repr(C)]
pub struct PJRT_DeviceDescription_ToString_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub device_description: *mut PJRT_DeviceDescription,
    pub to_string: *const c_char, // out
    pub to_string_size: usize,    // out
}
pjrt_struct!(PJRT_DeviceDescription_ToString_Args, to_string_size: usize);

// ---- executables ---------------------------------------------------------------
#[repr(C)]
pub struct PJRT_Executable_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_Executable,
}
pjrt_struct!(PJRT_Executable_Destroy_Args, executable: *mut PJRT_Executable);

#[repr(C)]
pub struct PJRT_LoadedExecutable_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_LoadedExecutable,
}
pjrt_struct!(PJRT_LoadedExecutable_Destroy_Args, executable: *mut PJRT_LoadedExecutable);

#[repr(C)]
pub struct PJRT_LoadedExecutable_GetExecutable_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub loaded_executable: *mut PJRT_LoadedExecutable,
    pub executable: *mut PJRT_Executable, // out, caller destroys
}
pjrt_struct!(PJRT_LoadedExecutable_GetExecutable_Args, executable: *mut PJRT_Executable);

#[repr(C)]
pub struct PJRT_Executable_Name_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_Executable,
    pub executable_name: *const c_char, // out
    pub executable_name_size: usize,    // out
}
pjrt_struct!(PJRT_Executable_Name_Args, executable_name_size: usize);

#[repr(C)]
pub struct PJRT_Executable_NumOutputs_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_Executable,
    pub num_outputs: usize, // out
}
pjrt_struct!(PJRT_Executable_NumOutputs_Args, num_outputs: usize);

#[repr(C)]
pub struct PJRT_Executable_OptimizedProgram_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_Executable,
    pub program: *mut PJRT_Program, // in/out
}
pjrt_struct!(PJRT_Executable_OptimizedProgram_Args, program: *mut PJRT_Program);

#[repr(C)]
pub struct PJRT_ExecuteOptions {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub send_callbacks: *mut *mut c_void, // PJRT_SendCallbackInfo**
    pub recv_callbacks: *mut *mut c_void, // PJRT_RecvCallbackInfo**
    pub num_send_ops: usize,
    pub num_recv_ops: usize,
    pub launch_id: c_int,
    pub non_donatable_input_indices: *const i64,
    pub num_non_donatable_input_indices: usize,
    pub context: *mut PJRT_ExecuteContext,
    pub call_location: *const c_char,
    pub num_tasks: usize,
    pub task_ids: *mut c_int,
    pub incarnation_ids: *mut i64,
}
pjrt_struct!(PJRT_ExecuteOptions, incarnation_ids: *mut i64);

#[repr(C)]
pub struct PJRT_LoadedExecutable_Execute_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub executable: *mut PJRT_LoadedExecutable,
    pub options: *mut PJRT_ExecuteOptions,
    pub argument_lists: *const *const *mut PJRT_Buffer, // [num_devices][num_args]
    pub num_devices: usize,
    pub num_args: usize,
    pub output_lists: *const *mut *mut PJRT_Buffer, // [num_devices][num_outputs], in/out
    pub device_complete_events: *mut *mut PJRT_Event, // [num_devices], in/out
    pub execute_device: *mut PJRT_Device,
}
pjrt_struct!(PJRT_LoadedExecutable_Execute_Args, execute_device: *mut PJRT_Device);

// ---- buffers ----------------------------------------------------------------------
#[repr(C)]
pub struct PJRT_Buffer_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub buffer: *mut PJRT_Buffer,
}
pjrt_struct!(PJRT_Buffer_Destroy_Args, buffer: *mut PJRT_Buffer);

#[repr(C)]
pub struct PJRT_Buffer_ElementType_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub buffer: *mut PJRT_Buffer,
    pub type_: PJRT_Buffer_Type, // out
}
pjrt_struct!(PJRT_Buffer_ElementType_Args, type_: PJRT_Buffer_Type);

#[repr(C)]
pub struct PJRT_Buffer_Dimensions_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub buffer: *mut PJRT_Buffer,
    pub dims: *const i64, // out, lifetime of buffer
    pub num_dims: usize,  // out
}
pjrt_struct!(PJRT_Buffer_Dimensions_Args, num_dims: usize);

#[repr(C)]
pub struct PJRT_Buffer_ToHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub src: *mut PJRT_Buffer,
    pub host_layout: *mut c_void, // PJRT_Buffer_MemoryLayout*, null = src layout
    pub dst: *mut c_void,         // in/out (null = size query)
    pub dst_size: usize,          // in/out
    pub event: *mut PJRT_Event,   // out, caller destroys
}
pjrt_struct!(PJRT_Buffer_ToHostBuffer_Args, event: *mut PJRT_Event);

// ---- the function table ---------------------------------------------------------
/// `PJRT_Api` exactly as in the 0.81 header: 118 function pointers after a
/// 40-byte header, so slot i lives at byte offset 40 + 8*i.
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut PJRT_Extension_Base,
    pub pjrt_api_version: PJRT_Api_Version,
    /* [  0] */ pub PJRT_Error_Destroy: VoidFn<PJRT_Error_Destroy_Args>,
    /* [  1] */ pub PJRT_Error_Message: VoidFn<PJRT_Error_Message_Args>,
    /* [  2] */ pub PJRT_Error_GetCode: ApiFn<PJRT_Error_GetCode_Args>,
    /* [  3] */ pub PJRT_Plugin_Initialize: ApiFn<PJRT_Plugin_Initialize_Args>,
    /* [  4] */ pub PJRT_Plugin_Attributes: ApiFn<PJRT_Plugin_Attributes_Args>,
    /* [  5] */ pub PJRT_Event_Destroy: ApiFn<PJRT_Event_Destroy_Args>,
    /* [  6] */ pub PJRT_Event_IsReady: Unused,
    /* [  7] */ pub PJRT_Event_Error: Unused,
    /* [  8] */ pub PJRT_Event_Await: ApiFn<PJRT_Event_Await_Args>,
    /* [  9] */ pub PJRT_Event_OnReady: Unused,
    /* [ 10] */ pub PJRT_Client_Create: ApiFn<PJRT_Client_Create_Args>,
    /* [ 11] */ pub PJRT_Client_Destroy: ApiFn<PJRT_Client_Destroy_Args>,
    /* [ 12] */ pub PJRT_Client_PlatformName: ApiFn<PJRT_Client_PlatformName_Args>,
    /* [ 13] */ pub PJRT_Client_ProcessIndex: Unused,
    /* [ 14] */ pub PJRT_Client_PlatformVersion: ApiFn<PJRT_Client_PlatformVersion_Args>,
    /* [ 15] */ pub PJRT_Client_Devices: Unused,
    /* [ 16] */
    pub PJRT_Client_AddressableDevices: ApiFn<PJRT_Client_AddressableDevices_Args>,
    /* [ 17] */ pub PJRT_Client_LookupDevice: Unused,
    /* [ 18] */ pub PJRT_Client_LookupAddressableDevice: Unused,
    /* [ 19] */ pub PJRT_Client_AddressableMemories: Unused,
    /* [ 20] */ pub PJRT_Client_Compile: ApiFn<PJRT_Client_Compile_Args>,
    /* [ 21] */ pub PJRT_Client_DefaultDeviceAssignment: Unused,
    /* [ 22] */
    pub PJRT_Client_BufferFromHostBuffer: ApiFn<PJRT_Client_BufferFromHostBuffer_Args>,
    /* [ 23] */ pub PJRT_DeviceDescription_Id: ApiFn<PJRT_DeviceDescription_Id_Args>,
    /* [ 24] */ pub PJRT_DeviceDescription_ProcessIndex: Unused,
    /* [ 25] */ pub PJRT_DeviceDescription_Attributes: Unused,
    /* [ 26] */ pub PJRT_DeviceDescription_Kind: ApiFn<PJRT_DeviceDescription_Kind_Args>,
    /* [ 27] */ pub PJRT_DeviceDescription_DebugString: Unused,
    /* [ 28] */
    pub PJRT_DeviceDescription_ToString: ApiFn<PJRT_DeviceDescription_ToString_Args>,
    /* [ 29] */ pub PJRT_Device_GetDescription: ApiFn<PJRT_Device_GetDescription_Args>,
    /* [ 30] */ pub PJRT_Device_IsAddressable: Unused,
    /* [ 31] */ pub PJRT_Device_LocalHardwareId: Unused,
    /* [ 32] */ pub PJRT_Device_AddressableMemories: Unused,
    /* [ 33] */ pub PJRT_Device_DefaultMemory: Unused,
    /* [ 34] */ pub PJRT_Device_MemoryStats: Unused,
    /* [ 35] */ pub PJRT_Memory_Id: Unused,
    /* [ 36] */ pub PJRT_Memory_Kind: Unused,
    /* [ 37] */ pub PJRT_Memory_DebugString: Unused,
    /* [ 38] */ pub PJRT_Memory_ToString: Unused,
    /* [ 39] */ pub PJRT_Memory_AddressableByDevices: Unused,
    /* [ 40] */ pub PJRT_Executable_Destroy: ApiFn<PJRT_Executable_Destroy_Args>,
    /* [ 41] */ pub PJRT_Executable_Name: ApiFn<PJRT_Executable_Name_Args>,
    /* [ 42] */ pub PJRT_Executable_NumReplicas: Unused,
    /* [ 43] */ pub PJRT_Executable_NumPartitions: Unused,
    /* [ 44] */ pub PJRT_Executable_NumOutputs: ApiFn<PJRT_Executable_NumOutputs_Args>,
    /* [ 45] */ pub PJRT_Executable_SizeOfGeneratedCodeInBytes: Unused,
    /* [ 46] */ pub PJRT_Executable_GetCostAnalysis: Unused,
    /* [ 47] */ pub PJRT_Executable_OutputMemoryKinds: Unused,
    /* [ 48] */
    pub PJRT_Executable_OptimizedProgram: ApiFn<PJRT_Executable_OptimizedProgram_Args>,
    /* [ 49] */ pub PJRT_Executable_Serialize: Unused,
    /* [ 50] */
    pub PJRT_LoadedExecutable_Destroy: ApiFn<PJRT_LoadedExecutable_Destroy_Args>,
    /* [ 51] */
    pub PJRT_LoadedExecutable_GetExecutable: ApiFn<PJRT_LoadedExecutable_GetExecutable_Args>,
    /* [ 52] */ pub PJRT_LoadedExecutable_AddressableDevices: Unused,
    /* [ 53] */ pub PJRT_LoadedExecutable_Delete: Unused,
    /* [ 54] */ pub PJRT_LoadedExecutable_IsDeleted: Unused,
    /* [ 55] */
    pub PJRT_LoadedExecutable_Execute: ApiFn<PJRT_LoadedExecutable_Execute_Args>,
    /* [ 56] */ pub PJRT_Executable_DeserializeAndLoad: Unused,
    /* [ 57] */ pub PJRT_LoadedExecutable_Fingerprint: Unused,
    /* [ 58] */ pub PJRT_Buffer_Destroy: ApiFn<PJRT_Buffer_Destroy_Args>,
    /* [ 59] */ pub PJRT_Buffer_ElementType: ApiFn<PJRT_Buffer_ElementType_Args>,
    /* [ 60] */ pub PJRT_Buffer_Dimensions: ApiFn<PJRT_Buffer_Dimensions_Args>,
    /* [ 61] */ pub PJRT_Buffer_UnpaddedDimensions: Unused,
    /* [ 62] */ pub PJRT_Buffer_DynamicDimensionIndices: Unused,
    /* [ 63] */ pub PJRT_Buffer_GetMemoryLayout: Unused,
    /* [ 64] */ pub PJRT_Buffer_OnDeviceSizeInBytes: Unused,
    /* [ 65] */ pub PJRT_Buffer_Device: Unused,
    /* [ 66] */ pub PJRT_Buffer_Memory: Unused,
    /* [ 67] */ pub PJRT_Buffer_Delete: Unused,
    /* [ 68] */ pub PJRT_Buffer_IsDeleted: Unused,
    /* [ 69] */ pub PJRT_Buffer_CopyToDevice: Unused,
    /* [ 70] */ pub PJRT_Buffer_ToHostBuffer: ApiFn<PJRT_Buffer_ToHostBuffer_Args>,
    /* [ 71] */ pub PJRT_Buffer_IsOnCpu: Unused,
    /* [ 72] */ pub PJRT_Buffer_ReadyEvent: Unused,
    /* [ 73] */ pub PJRT_Buffer_UnsafePointer: Unused,
    /* [ 74] */ pub PJRT_Buffer_IncreaseExternalReferenceCount: Unused,
    /* [ 75] */ pub PJRT_Buffer_DecreaseExternalReferenceCount: Unused,
    /* [ 76] */ pub PJRT_Buffer_OpaqueDeviceMemoryDataPointer: Unused,
    /* [ 77] */ pub PJRT_CopyToDeviceStream_Destroy: Unused,
    /* [ 78] */ pub PJRT_CopyToDeviceStream_AddChunk: Unused,
    /* [ 79] */ pub PJRT_CopyToDeviceStream_TotalBytes: Unused,
    /* [ 80] */ pub PJRT_CopyToDeviceStream_GranuleSize: Unused,
    /* [ 81] */ pub PJRT_CopyToDeviceStream_CurrentBytes: Unused,
    /* [ 82] */ pub PJRT_TopologyDescription_Create: Unused,
    /* [ 83] */ pub PJRT_TopologyDescription_Destroy: Unused,
    /* [ 84] */ pub PJRT_TopologyDescription_PlatformName: Unused,
    /* [ 85] */ pub PJRT_TopologyDescription_PlatformVersion: Unused,
    /* [ 86] */ pub PJRT_TopologyDescription_GetDeviceDescriptions: Unused,
    /* [ 87] */ pub PJRT_TopologyDescription_Serialize: Unused,
    /* [ 88] */ pub PJRT_TopologyDescription_Attributes: Unused,
    /* [ 89] */ pub PJRT_Compile: Unused,
    /* [ 90] */ pub PJRT_Executable_OutputElementTypes: Unused,
    /* [ 91] */ pub PJRT_Executable_OutputDimensions: Unused,
    /* [ 92] */ pub PJRT_Buffer_CopyToMemory: Unused,
    /* [ 93] */ pub PJRT_Client_CreateViewOfDeviceBuffer: Unused,
    /* [ 94] */ pub PJRT_Executable_Fingerprint: Unused,
    /* [ 95] */ pub PJRT_Client_TopologyDescription: Unused,
    /* [ 96] */ pub PJRT_Executable_GetCompiledMemoryStats: Unused,
    /* [ 97] */ pub PJRT_Memory_Kind_Id: Unused,
    /* [ 98] */ pub PJRT_ExecuteContext_Create: Unused,
    /* [ 99] */ pub PJRT_ExecuteContext_Destroy: Unused,
    /* [100] */ pub PJRT_Buffer_CopyRawToHost: Unused,
    /* [101] */ pub PJRT_AsyncHostToDeviceTransferManager_Destroy: Unused,
    /* [102] */ pub PJRT_AsyncHostToDeviceTransferManager_TransferData: Unused,
    /* [103] */ pub PJRT_Client_CreateBuffersForAsyncHostToDevice: Unused,
    /* [104] */ pub PJRT_AsyncHostToDeviceTransferManager_RetrieveBuffer: Unused,
    /* [105] */ pub PJRT_AsyncHostToDeviceTransferManager_Device: Unused,
    /* [106] */ pub PJRT_AsyncHostToDeviceTransferManager_BufferCount: Unused,
    /* [107] */ pub PJRT_AsyncHostToDeviceTransferManager_BufferSize: Unused,
    /* [108] */ pub PJRT_AsyncHostToDeviceTransferManager_SetBufferError: Unused,
    /* [109] */ pub PJRT_AsyncHostToDeviceTransferManager_AddMetadata: Unused,
    /* [110] */ pub PJRT_Client_DmaMap: Unused,
    /* [111] */ pub PJRT_Client_DmaUnmap: Unused,
    /* [112] */ pub PJRT_Client_CreateUninitializedBuffer: Unused,
    /* [113] */ pub PJRT_Client_UpdateGlobalProcessInfo: Unused,
    /* [114] */ pub PJRT_TopologyDescription_Deserialize: Unused,
    /* [115] */ pub PJRT_Client_CreateAliasBuffer: Unused,
    /* [116] */ pub PJRT_Client_FulfillAliasBuffer: Unused,
    /* [117] */ pub PJRT_LoadedExecutable_GetDeviceAssignment: Unused,
}
/// Header: PJRT_Api_STRUCT_SIZE = PJRT_STRUCT_SIZE(PJRT_Api, last fn ptr).
pub const PJRT_API_STRUCT_SIZE: usize =
    core::mem::offset_of!(PJRT_Api, PJRT_LoadedExecutable_GetDeviceAssignment)
        + core::mem::size_of::<Unused>();
const _: () = assert!(core::mem::size_of::<PJRT_Api>() == 40 + 118 * 8);
const _: () = assert!(PJRT_API_STRUCT_SIZE == core::mem::size_of::<PJRT_Api>());

pub type GetPjrtApiFn = unsafe extern "C" fn() -> *const PJRT_Api;
