//! GGUF metadata values: the thirteen value types and a typed, owned value.

use std::fmt;

/// The type tag of a metadata value, with the id GGUF stores before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgufValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl GgufValueType {
    /// The type with GGUF id `id`, or `None` for an id the spec does not assign.
    pub fn from_id(id: u32) -> Option<Self> {
        use GgufValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id GGUF stores for this type.
    pub fn id(self) -> u32 {
        use GgufValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The fewest bytes one value of this type occupies in a file: its exact size for the
    /// scalars, the length prefix for a string, the type tag and count for an array. Counts are
    /// checked against this before anything is allocated.
    pub fn min_encoded_len(self) -> u64 {
        use GgufValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

impl fmt::Display for GgufValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use GgufValueType::*;
        f.write_str(match self {
            U8 => "uint8",
            I8 => "int8",
            U16 => "uint16",
            I16 => "int16",
            U32 => "uint32",
            I32 => "int32",
            F32 => "float32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "uint64",
            I64 => "int64",
            F64 => "float64",
        })
    }
}

/// One metadata value, decoded and owned.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(GgufArray),
}

/// An array value: its element type (kept so an empty array still has one) and its elements,
/// each of that type. Elements may themselves be arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufArray {
    pub element_type: GgufValueType,
    pub values: Vec<GgufValue>,
}

impl GgufValue {
    /// Appends the value's GGUF encoding (little-endian; an array as its element type, count and
    /// elements), the inverse of what the reader parses. The value's type id is not written: in a
    /// metadata entry it precedes the value.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            GgufValue::U8(v) => out.extend(v.to_le_bytes()),
            GgufValue::I8(v) => out.extend(v.to_le_bytes()),
            GgufValue::U16(v) => out.extend(v.to_le_bytes()),
            GgufValue::I16(v) => out.extend(v.to_le_bytes()),
            GgufValue::U32(v) => out.extend(v.to_le_bytes()),
            GgufValue::I32(v) => out.extend(v.to_le_bytes()),
            GgufValue::U64(v) => out.extend(v.to_le_bytes()),
            GgufValue::I64(v) => out.extend(v.to_le_bytes()),
            GgufValue::F32(v) => out.extend(v.to_le_bytes()),
            GgufValue::F64(v) => out.extend(v.to_le_bytes()),
            GgufValue::Bool(v) => out.push(u8::from(*v)),
            GgufValue::String(s) => encode_string(out, s),
            GgufValue::Array(a) => {
                out.extend(a.element_type.id().to_le_bytes());
                out.extend((a.values.len() as u64).to_le_bytes());
                for v in &a.values {
                    v.encode(out);
                }
            }
        }
    }

    /// This value's type tag.
    pub fn value_type(&self) -> GgufValueType {
        match self {
            Self::U8(_) => GgufValueType::U8,
            Self::I8(_) => GgufValueType::I8,
            Self::U16(_) => GgufValueType::U16,
            Self::I16(_) => GgufValueType::I16,
            Self::U32(_) => GgufValueType::U32,
            Self::I32(_) => GgufValueType::I32,
            Self::F32(_) => GgufValueType::F32,
            Self::Bool(_) => GgufValueType::Bool,
            Self::String(_) => GgufValueType::String,
            Self::U64(_) => GgufValueType::U64,
            Self::I64(_) => GgufValueType::I64,
            Self::F64(_) => GgufValueType::F64,
            Self::Array(_) => GgufValueType::Array,
        }
    }

    /// The value if it is a `uint8`.
    pub fn as_u8(&self) -> Option<u8> {
        match *self {
            Self::U8(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is an `int8`.
    pub fn as_i8(&self) -> Option<i8> {
        match *self {
            Self::I8(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `uint16`.
    pub fn as_u16(&self) -> Option<u16> {
        match *self {
            Self::U16(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is an `int16`.
    pub fn as_i16(&self) -> Option<i16> {
        match *self {
            Self::I16(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `uint32`.
    pub fn as_u32(&self) -> Option<u32> {
        match *self {
            Self::U32(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is an `int32`.
    pub fn as_i32(&self) -> Option<i32> {
        match *self {
            Self::I32(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `uint64`.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Self::U64(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is an `int64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Self::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `float32`.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Self::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `float64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `bool`.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Self::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is a `string`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(v) => Some(v),
            _ => None,
        }
    }

    /// The value if it is an `array`.
    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            Self::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// Appends a GGUF string: its byte length as u64, then its UTF-8 bytes.
pub fn encode_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}
