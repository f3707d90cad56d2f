//! GGUF metadata values.
//!
//! An array keeps its element type next to its items (`Value::Array { elem, items }`):
//! the file stores the type once per array, and without it an empty array could not be
//! written back with the type it was read with.

use std::fmt;

/// Deepest array nesting accepted, so a hostile file cannot recurse the parser off the
/// stack. Real models use flat arrays; GGUF allows nesting, ggml itself does not.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Metadata value type ids (`gguf_type` in gguf.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_u32(id: u32) -> Option<Self> {
        use ValueType::*;
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

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Fewest bytes one value of this type takes in a file. The parser uses it to
    /// refuse counts that the bytes left in the file cannot possibly hold.
    pub fn min_encoded_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            // the u64 length of an empty string
            String => 8,
            // element type (u32) and count (u64) of an empty array
            Array => 12,
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    /// Every item has type `elem` (the writer refuses arrays where one does not).
    Array {
        elem: ValueType,
        items: Vec<Value>,
    },
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array { .. } => ValueType::Array,
        }
    }

    pub fn type_name(&self) -> &'static str {
        self.value_type().name()
    }

    /// Any integer that is not negative: converters disagree on the width and
    /// signedness of counts such as `block_count`, so readers should not care.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// f32, or f64 narrowed: hyperparameters like `rope.freq_base` come as either.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array { items, .. } => Some(items),
            _ => None,
        }
    }

    /// Why this value cannot be written as GGUF (mixed-type or too deeply nested
    /// array), or None if it can.
    pub(crate) fn shape_error(&self) -> Option<String> {
        self.shape_error_at(1)
    }

    fn shape_error_at(&self, depth: usize) -> Option<String> {
        let Value::Array { elem, items } = self else {
            return None;
        };
        if depth > MAX_ARRAY_DEPTH {
            return Some(format!(
                "arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
            ));
        }
        items.iter().enumerate().find_map(|(i, item)| {
            if item.value_type() != *elem {
                Some(format!(
                    "array of {elem} holds a {} at index {i}",
                    item.type_name()
                ))
            } else {
                item.shape_error_at(depth + 1)
            }
        })
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {
        $(impl From<$t> for Value {
            fn from(v: $t) -> Self {
                Value::$variant(v.into())
            }
        })*
    };
}

value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, bool => Bool, String => String, &str => String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip_and_unknown_ids_are_rejected() {
        for id in 0..=12 {
            let ty = ValueType::from_u32(id).expect("ids 0..=12 are defined");
            assert_eq!(ty as u32, id);
        }
        assert_eq!(ValueType::from_u32(13), None);
        assert_eq!(ValueType::from_u32(u32::MAX), None);
    }

    #[test]
    fn accessors_convert_only_what_is_lossless_enough() {
        assert_eq!(Value::I32(30).as_u64(), Some(30));
        assert_eq!(Value::I64(-1).as_u64(), None);
        assert_eq!(Value::U8(7).as_u64(), Some(7));
        assert_eq!(Value::F32(1.0).as_u64(), None);
        assert_eq!(Value::F64(0.5).as_f32(), Some(0.5));
        assert_eq!(Value::U32(1).as_f32(), None);
        assert_eq!(Value::from("llama").as_str(), Some("llama"));
        assert_eq!(Value::Bool(true).as_bool(), Some(true));
        let arr = Value::Array {
            elem: ValueType::U8,
            items: vec![Value::U8(1)],
        };
        assert_eq!(arr.as_array().map(<[Value]>::len), Some(1));
        assert_eq!(arr.type_name(), "array");
    }

    #[test]
    fn shape_errors_name_mixed_types_and_excess_depth() {
        let mixed = Value::Array {
            elem: ValueType::U32,
            items: vec![Value::U32(1), Value::I32(2)],
        };
        let err = mixed.shape_error().expect("mixed array must be refused");
        assert!(err.contains("array of u32 holds a i32 at index 1"), "{err}");

        let mut deep = Value::Array {
            elem: ValueType::U8,
            items: vec![],
        };
        for _ in 1..MAX_ARRAY_DEPTH {
            deep = Value::Array {
                elem: ValueType::Array,
                items: vec![deep],
            };
        }
        assert_eq!(deep.shape_error(), None);
        let deeper = Value::Array {
            elem: ValueType::Array,
            items: vec![deep],
        };
        assert!(deeper
            .shape_error()
            .is_some_and(|e| e.contains("nested deeper")));
    }
}
